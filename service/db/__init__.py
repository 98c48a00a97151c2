"""Persistence: SQLAlchemy models, Alembic migrations, the store."""
