"""flagella: the operator CLI."""
