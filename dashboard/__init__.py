"""The Streamlit dashboard: a client of the server; computes no statistics."""
