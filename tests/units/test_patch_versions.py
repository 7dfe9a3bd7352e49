"""Every patch of a dependency's internals is held to the release it was written for: with the installed version
faked to another, each patch site refuses before touching anything, naming the package, the version, the patch and
the release (`parity.patching`), and the command line says so in one `zerokl: error:` line."""

from __future__ import annotations

import importlib.metadata
import sys
import types
from pathlib import Path

import pytest

from parity import patching
from parity.patching import UnsupportedVersion

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def vllm_0_33(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.33.0")


@pytest.mark.parametrize("platform, first", [("cpu", 1), ("cuda", 2)])
def test_vllm_patches_refuse_another_release(vllm_0_33: None, platform: str, first: int) -> None:
    from rollout.vllm import compat

    with pytest.raises(UnsupportedVersion) as e:
        compat.check_version(platform)
    assert str(e.value).startswith(f"vllm 0.33.0 is not supported by patch {first} of rollout.vllm.compat "
                                   "(written for 0.32.0); "), str(e.value)


def test_every_vllm_patch_names_a_target_of_this_release() -> None:
    """Each patch's target exists in the installed vLLM (what `apply` wraps), on its platforms."""
    from rollout.vllm import compat

    assert [p.number for p in compat.PATCHES] == list(range(1, 11))
    for p in compat.PATCHES:
        owner, attr = patching.resolve(p.target)
        assert callable(getattr(owner, attr)), p.target
        assert set(p.platforms) <= {"cpu", "cuda"} and p.platforms, p


def test_plugin_edits_refuse_another_release(vllm_0_33: None) -> None:
    from rollout.vllm import plugin

    with pytest.raises(UnsupportedVersion, match=r"^vllm 0\.33\.0 is not supported by rollout\.vllm\.plugin's edits"):
        plugin.register()


def test_megatron_cpu_patches_refuse_another_release(monkeypatch: pytest.MonkeyPatch) -> None:
    import megatron.core

    from trainer.megatron import cpu_compat

    monkeypatch.setattr(megatron.core, "__version__", "0.17.0")
    with pytest.raises(UnsupportedVersion, match=r"^megatron-core 0\.17\.0 is not supported by "
                                                 r"trainer\.megatron\.cpu_compat \(written for 0\.16\.1\)"):
        cpu_compat.apply()


def test_fla_pinning_refuses_another_release(monkeypatch: pytest.MonkeyPatch) -> None:
    from parity.kernels import fla_pinned

    monkeypatch.setitem(sys.modules, "fla", types.SimpleNamespace(__version__="0.7.0"))
    with pytest.raises(UnsupportedVersion, match=r"^fla-core 0\.7\.0 is not supported by zerokl's pinning of fla's "
                                                 r"autotuned kernels \(written for 0\.6\.0\)"):
        fla_pinned.check_version()


def test_compressed_tensors_file_refuses_another_release(monkeypatch: pytest.MonkeyPatch) -> None:
    from parity.quant import mxfp4

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "0.18.0" if name == "compressed-tensors" else real(name))
    with pytest.raises(UnsupportedVersion, match=r"^compressed-tensors 0\.18\.0 is not supported by "
                                                 r"parity\.quant\.mxfp4's reading"):
        mxfp4._fp4_helpers.__wrapped__()


def test_serve_says_it_in_one_line(vllm_0_33: None, k3_tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`zerokl serve` stops before it starts vLLM (in-process: the check runs before the exec)."""
    from zerokl.cli import main

    assert main(["serve", "--checkpoint", str(k3_tiny)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["zerokl: error: vllm 0.33.0 is not supported by patch 1 of rollout.vllm.compat (written for "
                   "0.32.0); install vllm 0.32.0, the release zerokl pins"], err


def test_install_replaces_once_and_checks_the_target(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("zerokl_patch_target")
    module.f = lambda: 1
    monkeypatch.setitem(sys.modules, module.__name__, module)

    def wrap(original):  # noqa: ANN001, ANN202
        return lambda: original() + 1

    patching.install(f"{module.__name__}:f", wrap, "patch X")
    patching.install(f"{module.__name__}:f", wrap, "patch X")  # idempotent: still one wrap
    assert module.f() == 2 and module.f.__zerokl_patch__ == "patch X"
