"""Database layer: typed models, engine/session factory and the unit of work."""
