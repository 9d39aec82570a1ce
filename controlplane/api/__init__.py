"""HTTP adapters: thin routers that parse, check access, call a service and map errors."""
