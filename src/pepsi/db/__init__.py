"""Database access: connections, the embedded server, schema, named queries."""
