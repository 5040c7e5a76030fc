"""Server-side services: job dispatch and the load generator."""
