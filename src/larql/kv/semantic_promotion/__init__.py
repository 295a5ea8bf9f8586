"""`semantic-promotion`: a policy wrapper over another engine, observe mode only."""

from larql.kv.semantic_promotion.engine import SemanticPromotionEngine
from larql.kv.semantic_promotion.entry import ENTRY

__all__ = ["ENTRY", "SemanticPromotionEngine"]
