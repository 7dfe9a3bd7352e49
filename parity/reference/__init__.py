"""Float64 reference of the Kimi K3 text model (`ReferenceK3`) and its blocks; the spec, never a hot path."""

from parity.reference.model import ReferenceK3, ReferenceWeightsError

__all__ = ["ReferenceK3", "ReferenceWeightsError"]
