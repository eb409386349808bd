"""glmkit: run the GLM-5 family (glm_moe_dsa) from a quantized, memory-mapped container."""

__version__ = "0.1.0"
