"""The mlscope agent: advertises what it can serve, answers queries, publishes spans."""
