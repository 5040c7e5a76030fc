"""The Streamlit dashboard (issue 7): a client of the server; computes no statistics."""
