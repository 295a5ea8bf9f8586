"""`apollo`: retrieval + injection from a prebuilt store (reference §5.9)."""

from larql.kv.apollo.engine import ApolloEngine, build_apollo
from larql.kv.apollo.store import ApolloStore, ApolloStoreError

__all__ = ["ApolloEngine", "ApolloStore", "ApolloStoreError", "build_apollo"]
