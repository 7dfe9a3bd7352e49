"""Low-precision formats of K3 checkpoints and caches: MXFP4 routed experts (`mxfp4`), FP8 e4m3 MLA latents (`fp8`)."""
