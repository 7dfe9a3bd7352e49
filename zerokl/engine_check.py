"""`zerokl parity check` and `selftest`: sample with the real vLLM rollout engine, score the same token ids
with a real trainer's forward (the Megatron trainer, `trainer.backend`), compare every
sampled token's log-prob bit for bit.

Batch mixes: `random` (all prompts in one engine call, shuffled), `alone` (one prompt per call), `both`
(both, and the two rollouts must also agree with each other). On a mismatch the first mismatching
sequence is re-run through the shared forward on both sides (rollout weights + decode schedule vs trainer
weights + one pass), capturing every block, and the first block whose outputs differ is named.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from parity.compare import DumpError, ParityReport, SequenceLogprobs, compare, jsonl_rows
from parity.config import ConfigError, ModelConfig
from parity.diagnose import Divergence, diagnose
from parity.image import ImageEncoder
from parity.kernels import get_kernels
from parity.model import K3Forward, K3Weights
from parity.io.checkpoint import load_checkpoint
from rollout.sampling import ImagePrompt
from zerokl.tasks import make_task

ENGINE_ARGS = {"max_model_len": 1024, "max_num_seqs": 32, "gpu_memory_utilization": 0.5}


@dataclass
class CheckResult:
    report: ParityReport
    rollout: list[SequenceLogprobs]
    trainer: list[SequenceLogprobs]
    diagnosis: Divergence | None
    mix_mismatch: int  # sequences whose `alone` and `random` rollouts differ (batch-mix both)


PROMPT_KEYS = ("prompt", "prompt_token_ids")
IMAGES_KEY = "images"
CHAT_KEYS = ("messages", "tools")


def load_prompts(path: str | Path, tokenizer: Any, vocab_size: int, max_prompt_len: int,
                 checkpoint: str | Path | None = None) -> list[list[int] | ImagePrompt]:
    """JSONL, one object per line with exactly one of {"prompt": non-empty text} or {"prompt_token_ids": [ids]}: ids
    are ints in [0, vocab_size), at most `max_prompt_len` tokens either way; optionally "images": [paths, relative to
    the file] (a K3 `checkpoint` with a vision tower), placed at the prompt's `<|kimi_image_placeholder|>` tokens (one
    per image) or, with none, before the text; the prompt with its images expanded must fit `max_prompt_len`. A chat
    line, {"messages": [...], "tools": [...]} (tools optional), is the generation prompt the checkpoint's chat
    template renders, as the server's chat endpoint renders it (`parity.io.chat_format.chat_prompt_ids`), its
    `image_url` parts (file paths relative to the file) the images at the placeholders the template puts. Every
    line is checked (and every image read) before anything runs; the first bad one fails with the file, the line and
    the reason (`DumpError`). Blank lines are skipped."""
    path = Path(path)
    if not path.is_file():
        raise DumpError(f"--prompts {path}: no such file")
    prompts: list[list[int] | ImagePrompt] = []
    for lineno, row in jsonl_rows(path):
        where = f"{path}:{lineno}"
        if isinstance(row, dict) and "messages" in row:
            prompts.append(_chat_prompt(row, where, path.parent, tokenizer, checkpoint, max_prompt_len))
            continue
        images = row.pop(IMAGES_KEY, None) if isinstance(row, dict) else None
        ids = _prompt_ids(row, where, tokenizer, vocab_size, max_prompt_len)
        prompts.append(ids if images is None else
                       _image_prompt(ids, images, where, path.parent, tokenizer, checkpoint, max_prompt_len))
    if not prompts:
        raise DumpError(f"{path}: no prompts")
    return prompts


def _chat_prompt(row: dict, where: str, root: Path, tokenizer: Any, checkpoint: str | Path | None,
                 max_prompt_len: int) -> list[int] | ImagePrompt:
    """The ids of a chat line's generation prompt, with the images of its image parts (file paths relative to `root`)
    as an `ImagePrompt`; refused with the line when malformed or too long."""
    import jinja2

    from parity.io.chat_format import ChatError, chat_images, chat_prompt_ids

    unknown = sorted(set(row) - set(CHAT_KEYS))
    if unknown:
        raise DumpError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; a chat line holds 'messages' and "
                        "optionally 'tools'")
    if checkpoint is None:
        raise DumpError(f"{where}: a chat line needs the checkpoint's chat template")
    try:
        ids = chat_prompt_ids(checkpoint, row["messages"], row.get("tools"))
    except (ChatError, jinja2.TemplateError) as e:
        raise DumpError(f"{where}: {e}") from None
    images = chat_images(row["messages"])
    if images:  # read, and the prompt with them expanded measured, there
        return _image_prompt(ids, images, where, root, tokenizer, checkpoint, max_prompt_len)
    if len(ids) > max_prompt_len:
        raise DumpError(f"{where}: the chat renders to {len(ids)} tokens; at most {max_prompt_len} fit the engine's "
                        "context with the completion")
    return ids


def _image_prompt(ids: list[int], images: Any, where: str, root: Path, tokenizer: Any,
                  checkpoint: str | Path | None, max_prompt_len: int) -> ImagePrompt:
    """The prompt's ids with one placeholder per image (added in front when the prompt has none) and its images read;
    refused when the checkpoint has no vision tower or the expanded prompt does not fit."""
    from parity.config import load_model_config
    from parity.image import IMAGE_PLACEHOLDER, ImageError, ImageProcessing, open_image

    if not isinstance(images, list) or not images or not all(isinstance(i, str) and i for i in images):
        raise DumpError(f"{where}: 'images' must be a non-empty list of image file paths, got {images!r}")
    if checkpoint is None or load_model_config(checkpoint).vision is None:
        raise DumpError(f"{where}: the prompt has images, but the checkpoint has no vision tower (no vision_config)")
    try:
        pictures = tuple(open_image(root / i) for i in images)
        processing = ImageProcessing.from_checkpoint(checkpoint)
    except ImageError as e:
        raise DumpError(f"{where}: {e}") from None
    placeholder = tokenizer.token_to_id(IMAGE_PLACEHOLDER)
    held = ids.count(placeholder)
    if held == 0:
        ids = [placeholder] * len(pictures) + ids
    elif held != len(pictures):
        raise DumpError(f"{where}: the prompt holds {held} {IMAGE_PLACEHOLDER} tokens for {len(pictures)} images; "
                        "give one per image, or none (the images then go first)")
    expanded = len(ids) - len(pictures) + sum(_image_len(tokenizer, processing, p) for p in pictures)
    if expanded > max_prompt_len:
        raise DumpError(f"{where}: with its {len(pictures)} images the prompt has {expanded} tokens; at most "
                        f"{max_prompt_len} fit the engine's context with the completion")
    return ImagePrompt(ids, pictures)


def _image_len(tokenizer: Any, processing: Any, image: Any) -> int:
    """Tokens one image takes in the engine's prompt: K3's `<|media_begin|>image WxH<|media_content|>`, one pad per
    merged patch, `<|media_end|>` (vLLM's `KimiK3MultiModalProcessor`; this tokenizer holds only the pad, which is
    the placeholder token, as a special token)."""
    from parity.image import IMAGE_PLACEHOLDER

    w, h = image.size
    pads = IMAGE_PLACEHOLDER * processing.num_tokens(image)
    return len(tokenizer.encode(f"<|media_begin|>image {w}x{h}<|media_content|>{pads}<|media_end|>",
                                add_special_tokens=False).ids)


def _prompt_ids(row: Any, where: str, tokenizer: Any, vocab_size: int, max_prompt_len: int) -> list[int]:
    if not isinstance(row, dict):
        raise DumpError(f"{where}: expected an object with 'prompt' or 'prompt_token_ids', got {type(row).__name__}")
    unknown = sorted(set(row) - set(PROMPT_KEYS))
    if unknown:
        raise DumpError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; a prompt line holds 'prompt' or "
                        "'prompt_token_ids', and optionally 'images'")
    if len(row) != 1:
        raise DumpError(f"{where}: expected one of 'prompt' or 'prompt_token_ids', got {len(row)}")
    if "prompt" in row:
        text = row["prompt"]
        if not isinstance(text, str) or not text.strip():
            raise DumpError(f"{where}: 'prompt' must be non-empty text, got {text!r}")
        ids = tokenizer.encode(text).ids
    else:
        ids = row["prompt_token_ids"]
        if not isinstance(ids, list) or not ids:
            raise DumpError(f"{where}: 'prompt_token_ids' must be a non-empty list of token ids, got {ids!r}")
        bad = [i for i, t in enumerate(ids)
               if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise DumpError(f"{where}: prompt_token_ids[{bad[0]}] = {ids[bad[0]]!r} is not a token id (an integer in "
                            f"[0, {vocab_size}), the vocabulary)")
    if len(ids) > max_prompt_len:
        raise DumpError(f"{where}: the prompt has {len(ids)} tokens; at most {max_prompt_len} fit the engine's context "
                        "with the completion")
    return list(ids)


def task_prompts(n: int, seed: int, tokenizer: Any) -> list[list[int]]:
    """`n` prompts from the shipped addition task."""
    task, rng = make_task("addition", digits=2), random.Random(seed)
    return [tokenizer.encode(task.sample(rng).prompt).ids for _ in range(n)]


class TensorParallelScorer:
    """The Megatron trainer's log-probs at TP = `tp` on `tp` local ranks (`trainer.megatron.tp_score`), one launch
    per call; `logprobs` as `TrainerBackend.logprobs`."""

    def __init__(self, checkpoint: Path, tp: int, kernels: str, adapter: str | Path | None):
        from trainer.megatron.sharding import check_divisible

        try:  # a bad --tp fails here, before anything starts
            check_divisible(load_checkpoint(checkpoint)[0].text, tp, 1)
        except ValueError as e:
            raise ConfigError(f"--tp {tp}: {e}") from None
        self.checkpoint, self.tp, self.kernels, self.adapter = checkpoint, tp, kernels, adapter

    def logprobs(self, batch: Any, temperature: float) -> torch.Tensor:
        import sys
        import tempfile

        from trainer.megatron import tp_score
        from zerokl.launch import run_ranks

        if batch.images is not None and any(batch.images.rows):
            raise ConfigError(f"image prompts with --tp {self.tp} are not built: the TP ranks score token ids only")
        with tempfile.TemporaryDirectory(prefix="zerokl-tp-") as tmp:
            torch.save({"input_ids": batch.input_ids, "lens": batch.lens}, Path(tmp) / tp_score.BATCH_FILE)
            cmd = [sys.executable, "-m", "trainer.megatron.tp_score", "--checkpoint", str(self.checkpoint),
                   "--tp", str(self.tp), "--kernels", self.kernels, "--temperature", repr(temperature), "--dir", tmp]
            if self.adapter is not None:
                cmd += ["--adapter", str(self.adapter)]
            print(f"scoring {batch.input_ids.shape[0]} sequences with the trainer at TP = {self.tp} "
                  f"({self.tp} ranks)", flush=True)
            rc = run_ranks(cmd, self.tp)
            if rc != 0:
                raise RuntimeError(f"the TP = {self.tp} trainer ranks failed (exit {rc}); their output is above")
            return torch.load(Path(tmp) / tp_score.LOGPROBS_FILE, weights_only=True)

    def close(self) -> None:
        """Nothing stays up between calls."""


class Checker:
    """A rollout engine and a trainer model on the same checkpoint (and LoRA adapter), kept alive across checks."""

    def __init__(self, model: str | Path, kernels: str = "invariant", engine_args: dict[str, Any] | None = None,
                 lora: str | Path | None = None, tp: int = 1):
        """The trainer: `trainer.backend.build_backend` in this one process; `tp` > 1: the Megatron trainer at that
        tensor parallelism on `tp` local ranks (`TensorParallelScorer`). A checkpoint with
        a vision tower takes image prompts (`ImagePrompt`): the engine serves the tower, and the trainer's image rows
        come from the same tower."""
        from lora.adapter import load_adapter
        from rollout.engine import RolloutEngine, lora_engine_args
        from tokenizers import Tokenizer
        from trainer.backend import build_backend

        self.path = Path(model)
        self.kernels = kernels
        self.cfg, self.tensors = load_checkpoint(self.path)
        self.adapter = load_adapter(lora, self.cfg.text) if lora is not None else None
        self.tokenizer = Tokenizer.from_file(str(self.path / "tokenizer.json"))
        if tp > 1:
            self.backend = TensorParallelScorer(self.path, tp, kernels, lora)
        else:
            self.backend = build_backend(self.path, kernels=kernels, adapter=self.adapter)
        args = dict(engine_args or ENGINE_ARGS)
        if self.adapter is not None:
            ranks = [self.adapter.spec.rank(m) for m in self.adapter.weights]
            args.update(lora_engine_args(max(ranks)))
        self.images = ImageEncoder(self.path, self.cfg, self.tensors, get_kernels(kernels)) if self.cfg.vision else None
        self.engine = RolloutEngine(self.path, kernels=kernels, **args)
        self.lora_request = self.engine.load_adapter("adapter", lora) if lora is not None else None

    def rollout(self, prompts: list[list[int] | ImagePrompt], mix: str, max_tokens: int, temperature: float,
                seed: int) -> list[Any]:
        """Samples in prompt order; `random` submits them shuffled in one call, `alone` one call each."""
        seeds = [seed * 1_000_003 + i for i in range(len(prompts))]
        if mix == "alone":
            return [self.engine.generate([p], temperature=temperature, max_tokens=max_tokens, seed=[s],
                                         lora=self.lora_request)[0]
                    for p, s in zip(prompts, seeds)]
        order = list(range(len(prompts)))
        random.Random(seed).shuffle(order)
        out = self.engine.generate([prompts[i] for i in order], temperature=temperature, max_tokens=max_tokens,
                                   seed=[seeds[i] for i in order], lora=self.lora_request)
        back: list[Any] = [None] * len(prompts)
        for pos, i in enumerate(order):
            back[i] = out[pos]
        return back

    def score(self, samples: list[Any], temperature: float,
              prompts: list[list[int] | ImagePrompt] | None = None) -> list[torch.Tensor]:
        """The trainer's log-probs of each sample's completion tokens (one padded forward, no grad); `prompts`: each
        sample's prompt, whose images fill its image rows."""
        from trainer.logprobs import PaddedBatch

        with_images = prompts is not None and any(isinstance(p, ImagePrompt) for p in prompts)
        rows = None
        if with_images and self.images is not None:
            rows = self.images.rows([p.images if isinstance(p, ImagePrompt) else () for p in prompts])
        lp = self.backend.logprobs(PaddedBatch.from_sequences([s.prompt_ids + s.completion_ids for s in samples],
                                                              images=rows), temperature)
        return [lp[i, len(s.prompt_ids) - 1: len(s.prompt_ids) - 1 + len(s.completion_ids)]
                for i, s in enumerate(samples)]

    def check(self, prompts: list[list[int] | ImagePrompt], mix: str = "both", max_tokens: int = 32, temperature: float = 1.0,
              seed: int = 0, diagnose_failures: bool = True,
              rollout_weights: dict[str, torch.Tensor] | None = None) -> CheckResult:
        """Compare rollout and trainer log-probs; `rollout_weights` are what the engine holds when they
        differ from the checkpoint (the selftest's perturbed weights)."""
        mixes = ["random", "alone"] if mix == "both" else [mix]
        runs = {m: self.rollout(prompts, m, max_tokens, temperature, seed) for m in mixes}
        mix_mismatch = 0
        if mix == "both":
            mix_mismatch = sum(a.completion_ids != b.completion_ids or not torch.equal(a.logprobs, b.logprobs)
                               for a, b in zip(runs["random"], runs["alone"]))
        labelled = [(f"{m}-{i}", s) for m, samples in runs.items() for i, s in enumerate(samples)]
        scored = self.score([s for _, s in labelled], temperature, prompts * len(mixes))  # one batch for every mix
        rollout_seqs, trainer_seqs = [], []
        for (label, s), lp in zip(labelled, scored):
            rollout_seqs.append(SequenceLogprobs(label, s.completion_ids, s.logprobs, s.prompt_ids))
            trainer_seqs.append(SequenceLogprobs(label, s.completion_ids, lp.clone(), s.prompt_ids))
        report = compare(rollout_seqs, trainer_seqs)
        div = None
        text_ids = {f"{m}-{i}" for m in mixes for i, p in enumerate(prompts) if not isinstance(p, ImagePrompt)}
        failed = [d.id for d in report.sequences if d.first_mismatch is not None and d.id in text_ids]
        if diagnose_failures and failed:  # the block-by-block replay runs token ids: text prompts only
            seq = next(s for s in rollout_seqs if s.id == failed[0])
            div = self.diagnose(seq, rollout_weights)
        return CheckResult(report, rollout_seqs, trainer_seqs, div, mix_mismatch)

    def diagnose(self, seq: SequenceLogprobs, rollout_weights: dict[str, torch.Tensor] | None) -> Divergence | None:
        kernels = get_kernels(self.kernels)
        lora = self.adapter.lora() if self.adapter is not None else {}
        trainer_side = K3Forward(K3Weights.from_official(self.cfg.text, self.tensors), kernels)
        rollout_side = K3Forward(K3Weights.from_official(self.cfg.text, rollout_weights or self.tensors), kernels)
        trainer_side.w.lora = rollout_side.w.lora = lora
        tokens = seq.prompt_token_ids + seq.token_ids
        return diagnose((rollout_side, "decode"), (trainer_side, "one_pass"), tokens, prefill=len(seq.prompt_token_ids))

    def close(self) -> None:
        self.engine.close()
        self.backend.close()


def expected_block(cfg: ModelConfig, name: str) -> str:
    """The first captured block a change to tensor `name` can alter (see parity.diagnose's block order)."""
    parts = name.split(".")
    if "layers" in parts:
        i = int(parts[parts.index("layers") + 1])
        rest = ".".join(parts[parts.index("layers") + 2:])
        attn_side = ("self_attn.", "input_layernorm.", "self_attention_res_")
        return f"layer{i}.attn" if rest.startswith(attn_side) else f"layer{i}.mlp"
    if "embed_tokens" in name:
        return "embed"
    if "output_attn_res" in name:
        return "final"
    return "logits"


@dataclass(frozen=True)
class Trial:
    tensor: str
    index: int
    detected: bool
    expected_block: str
    diagnosed_block: str | None
    redraws: int  # earlier draws whose one-ulp change altered no log-prob at all (nothing to detect)

    @property
    def ok(self) -> bool:
        return self.detected and self.diagnosed_block == self.expected_block


def selftest(checker: Checker, prompts: list[list[int]], trials: int = 20, seed: int = 0, max_tokens: int = 16,
             temperature: float = 1.0, log: Any = print) -> list[Trial]:
    """Perturb one random weight element by one ulp of its serving dtype (`parity.weights.serving_dtype`) on the
    rollout side only, `trials` times; each time
    `check` must fail and the diagnosis must name the block that tensor feeds. A draw whose change alters no
    sampled log-prob (verified through the shared forward) has nothing to detect and is redrawn, counted."""
    from parity.weights import master_weights, serving_weights
    from parity.sync.bundle import WeightBundle

    rng = random.Random(seed)
    base = serving_weights(checker.cfg.text, master_weights(checker.cfg.text, checker.tensors))
    names = sorted(n for n, t in base.items() if t.is_floating_point())  # not the packed MXFP4 halves
    results = []
    for trial in range(trials):
        redraws = 0
        while True:
            name = rng.choice(names)
            index = rng.randrange(base[name].numel())
            perturbed = dict(base)
            t = base[name].clone()
            flat = t.view(-1)
            flat[index] = torch.nextafter(flat[index], torch.tensor(float("inf"), dtype=t.dtype))
            perturbed[name] = t
            checker.engine.update_weights(WeightBundle.make(checker.engine.policy_version + 1, perturbed))
            res = checker.check(prompts, mix="random", max_tokens=max_tokens, temperature=temperature,
                                seed=seed + trial, rollout_weights=perturbed)
            checker.engine.update_weights(WeightBundle.make(checker.engine.policy_version + 1, base))
            if res.report.all_equal and _no_effect(checker, res, perturbed, temperature):
                redraws += 1
                continue
            block = res.diagnosis.block if res.diagnosis else None
            trial_result = Trial(name, index, not res.report.all_equal, expected_block(checker.cfg, name), block, redraws)
            log(f"trial {trial + 1}/{trials}: {name}[{index}] +1 ulp -> "
                f"{'detected' if trial_result.detected else 'MISSED'}, diagnosis {block} "
                f"(expected {trial_result.expected_block}){'' if trial_result.ok else '  <-- WRONG'}"
                f"{f'; {redraws} earlier draws changed no log-prob' if redraws else ''}")
            results.append(trial_result)
            break
    return results


def _no_effect(checker: Checker, res: CheckResult, perturbed: dict[str, torch.Tensor], temperature: float) -> bool:
    """True when the perturbed weights give exactly the unperturbed log-probs on the sampled sequences."""
    from parity.model import score_sequences

    fwd = K3Forward(K3Weights.from_official(checker.cfg.text, perturbed), get_kernels(checker.kernels))
    seqs = [s.prompt_token_ids + s.token_ids for s in res.rollout]
    scored = score_sequences(fwd, seqs, temperature)
    return all(torch.equal(lp[len(s.prompt_token_ids) - 1:], s.logprobs) for lp, s in zip(scored, res.rollout))
