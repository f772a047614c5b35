"""Route modules, one a resource; ``api.app`` includes each router."""
