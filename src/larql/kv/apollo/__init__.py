"""`apollo`: retrieval + injection from a prebuilt store."""

from larql.kv.apollo.engine import ApolloEngine, build_apollo
from larql.kv.apollo.entry import ENTRY
from larql.kv.apollo.store import ApolloStore, ApolloStoreError

__all__ = ["ENTRY", "ApolloEngine", "ApolloStore", "ApolloStoreError", "build_apollo"]
