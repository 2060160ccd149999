"""Serve a Hugging Face Llama through the kernel cache: paged KV, zero compiles.

    python examples/hf_generate.py [ENGINE OPTIONS] [--cache-dir DIR] [--warmup] \
        [--layers 2] [--requests 4] [--max-new-tokens N] [--prefill-chunk N] \
        [--trace CSV] [--start 0] [--untimed 1] [--json]

Needs transformers (``pip install -e '.[hf]'``). Builds a ``LlamaForCausalLM``
with random weights (nothing is downloaded) whose attention has the plan's
geometry (``--model``: heads, KV heads, head_dim; hidden size heads * head_dim)
and ``--layers`` layers. Its attention runs through transformers' attention
registry (``AttentionInterface.register``, ``attn_implementation=``): the
model applies the rotary embeddings, then :func:`paged_attention` writes the
new keys and values into a paged KV cache (vLLM layout, one pool per layer)
and calls the plan's runtime: ``prefill`` for each prompt chunk, ``decode``
for the whole batch at each step.

Requests take prompt and output lengths from the Azure trace (random prompt
tokens); lengths that do not fit ``max_model_len`` are scaled down (printed).
Requests are served in waves of ``max_num_seqs``: each prompt is prefilled in
chunks of ``--prefill-chunk`` tokens (default: the plan's largest query
bucket), then the wave decodes together. The same weights then generate with
transformers' own attention (SDPA, its dynamic cache, ``generate`` one request
at a time) and the greedy tokens and logits are compared. Both paths run
``--untimed`` passes first (one-time costs of first calls), then one timed
pass. Prints both paths' tokens/s (output tokens over the wall time of the
timed pass, prefill included), the timed pass's kernel calls per variant and
the Inductor compiles torch counted in this process since engine start (0:
``attn.stats()["compiles"]``). Exit status 0
when every token matches and nothing compiled, 1 otherwise, 2 on an error
(a plan that is not warm: the error gives the warmup command; ``--warmup`` runs it).

Trace data: Microsoft Azure Public Dataset, AzureLLMInferenceTrace_conv (2023),
CC BY 4.0 ("Splitwise", ISCA 2024).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass

import torch
from replay_trace import DEFAULT_TRACE, TRACE_IN_REPO, TRACE_SOURCE, check_trace  # this folder

from kernel_cache import MissingVariantsError, load_plan
from kernel_cache.config.engine import config_to_cli
from kernel_cache.errors import KernelCacheError
from warmup.cli.options import CACHE_DIR_HELP, cache_dir_of, config_from_args, engine_options
from warmup.request_lengths import read_trace

ATTN_NAME = "kernel_cache"
VOCAB = 1024


@dataclass
class Step:
    """One forward pass of the paged path: which wave slots it serves and each
    one's KV length after it (tokens, the new tokens included). Reaches
    :func:`paged_attention` as the ``kc_step`` keyword of the model call."""

    kv: PagedKV
    decode: bool
    slots: list[int]
    seq_lens: list[int]
    rows: torch.Tensor  # [tokens] int64: each new token's row in a layer's flat KV view


class PagedKV:
    """The engine's paged KV cache and the plan's runtime.

    ``key_cache[layer]`` / ``value_cache[layer]``: ``[num_pool_blocks, block_size,
    num_kv_heads, head_dim]`` (vLLM's layout); wave slot ``s`` owns blocks
    ``tables[s]`` (int32, ``[max_num_seqs, max_blocks]``).
    """

    def __init__(self, rt, layers: int):
        c = self.config = rt.config
        self.rt = rt
        pool = c.max_num_seqs * c.max_blocks
        shape = (layers, pool, c.block_size, c.num_kv_heads, c.head_dim)
        self.key_cache = torch.zeros(shape, dtype=c.torch_dtype(), device=c.device)
        self.value_cache = torch.zeros_like(self.key_cache)
        self.tables = torch.arange(pool, dtype=torch.int32, device=c.device).view(
            c.max_num_seqs, c.max_blocks
        )

    def step(self, decode: bool, slots: list[int], seq_lens: list[int], new: int) -> Step:
        """A :class:`Step` whose ``new`` last tokens of each slot are written."""
        bs = self.config.block_size
        pos = torch.cat([torch.arange(n - new, n) for n in seq_lens])
        slot = torch.tensor(slots).repeat_interleave(new)
        rows = self.tables.cpu()[slot, pos // bs].long() * bs + pos % bs
        return Step(self, decode, slots, seq_lens, rows.to(self.config.device))


def paged_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """transformers attention function: paged KV write, then the plan's kernels.

    Args:
        module: the model's attention module (``layer_idx`` picks the KV pool).
        query: ``[batch, num_heads, new_tokens, head_dim]``, rotary embeddings applied.
        key, value: ``[batch, num_kv_heads, new_tokens, head_dim]``, the new tokens only.
        attention_mask: ignored (the kernels are causal over each sequence's KV).
        kwargs: ``kc_step``, the :class:`Step` of this forward pass.

    Returns: ``([batch, new_tokens, num_heads, head_dim], None)``.

    Raises:
        ValueError: a scale other than the kernels' ``1/sqrt(head_dim)``, or no ``kc_step``.
    """
    step: Step | None = kwargs.get("kc_step")
    if step is None:
        raise ValueError(f"attn_implementation={ATTN_NAME!r} needs the kc_step keyword")
    head_dim = query.shape[-1]
    if scaling is not None and not math.isclose(scaling, head_dim**-0.5):
        raise ValueError(f"scaling {scaling} is not 1/sqrt(head_dim={head_dim}) of the kernels")
    kv, layer = step.kv, module.layer_idx
    kc, vc = kv.key_cache[layer], kv.value_cache[layer]
    kvh = kc.shape[2]
    kc.view(-1, kvh, head_dim)[step.rows] = key.transpose(1, 2).reshape(-1, kvh, head_dim)
    vc.view(-1, kvh, head_dim)[step.rows] = value.transpose(1, 2).reshape(-1, kvh, head_dim)
    if step.decode:  # every slot has one new token
        out = kv.rt.decode(query[:, :, 0], kc, vc, kv.tables[step.slots], step.seq_lens)
        return out.unsqueeze(1), None
    out = kv.rt.prefill(
        query[0].transpose(0, 1), kc, vc, kv.tables[step.slots[0]], step.seq_lens[0]
    )
    return out.unsqueeze(0), None


def build_models(cfg, layers: int, seed: int = 0):
    """``(paged, reference)``: one random-weight Llama with ``cfg``'s attention
    geometry, twice (the same weights), attention through :func:`paged_attention`
    and through transformers' SDPA."""
    from transformers import AttentionInterface, AutoModelForCausalLM, LlamaConfig

    AttentionInterface.register(ATTN_NAME, paged_attention)
    hidden = cfg.num_heads * cfg.head_dim
    hf = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_model_len,
        bos_token_id=None,
        eos_token_id=None,  # generate every requested token
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    models = []
    for impl in (ATTN_NAME, "sdpa"):
        # each model its own config: from_config records the implementation in it
        m = AutoModelForCausalLM.from_config(copy.deepcopy(hf), attn_implementation=impl)
        if models:
            m.load_state_dict(models[0].state_dict())
        models.append(m.to(device=cfg.device, dtype=cfg.torch_dtype()).eval())
    return models


@dataclass
class Request:
    """A request: its trace row, prompt token ids and output length (tokens)."""

    row: int
    prompt: list[int]
    new_tokens: int
    note: str = ""


def make_requests(trace, count, start, max_model_len, max_new=None, seed=0) -> list[Request]:
    """``count`` requests from trace rows ``start ..``, random prompt tokens.

    Prompt + output must fit ``max_model_len`` (the last output token's KV is
    never written, so the KV peaks one below). A longer request is scaled down
    by one factor on both lengths (at least 1 token each); an empty prompt
    gets one token; ``max_new`` first clips the output. Each change is
    described in the request's ``note``.
    """
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, r in enumerate(read_trace(trace, limit=count, start=start)):
        ctx, gen, notes = r.context_tokens, max(1, r.generated_tokens), []
        if ctx < 1:  # at least one prompt token (as warmup.request_lengths.fit_request)
            ctx, notes = 1, ["prompt raised to 1 token"]
        if max_new is not None and gen > max_new:
            gen, notes = max_new, [f"output clipped to --max-new-tokens {max_new}"]
        if ctx + gen > max_model_len:
            f = max_model_len / (ctx + gen)
            ctx = min(max(1, math.floor(ctx * f)), max_model_len - 1)
            gen = max(1, min(gen, max_model_len - ctx))
            notes.append(f"scaled by {f:.3f} to fit max_model_len {max_model_len}")
        note = ""
        if notes:
            note = (
                f"trace row {start + i}: {r.context_tokens} prompt + {r.generated_tokens} output "
                f"tokens -> {ctx} + {gen} ({'; '.join(notes)})"
            )
        prompt = torch.randint(0, VOCAB, (ctx,), generator=g).tolist()
        out.append(Request(start + i, prompt, gen, note))
    return out


def forward(model, step: Step, ids: list[list[int]], first_pos: list[int]) -> torch.Tensor:
    """Logits ``[len(ids), vocab]`` (float32) of each row's last token; row ``i``'s
    tokens sit at positions ``first_pos[i] ..`` of its sequence (rotary embeddings)."""
    dev = step.kv.config.device
    x = torch.tensor(ids, device=dev)
    pos = torch.tensor(first_pos, device=dev)[:, None] + torch.arange(x.shape[1], device=dev)
    out = model(input_ids=x, position_ids=pos, use_cache=False, kc_step=step)
    return out.logits[:, -1].float()


def serve(model, kv: PagedKV, requests: list[Request], chunk: int) -> list[tuple]:
    """Greedy generation through the paged cache, in waves of ``max_num_seqs``:
    each prompt prefilled in chunks of ``chunk`` tokens, then the wave decodes
    together. Returns ``(tokens, logits [new_tokens, vocab])`` per request."""
    results = []
    for w in range(0, len(requests), kv.config.max_num_seqs):
        wave = requests[w : w + kv.config.max_num_seqs]
        toks: list[list[int]] = [[] for _ in wave]
        logits: list[list[torch.Tensor]] = [[] for _ in wave]
        for s, r in enumerate(wave):
            for done in range(0, len(r.prompt), chunk):
                ids = r.prompt[done : done + chunk]
                last = forward(
                    model, kv.step(False, [s], [done + len(ids)], len(ids)), [ids], [done]
                )
            logits[s].append(last[0])
            toks[s].append(int(last[0].argmax()))
        while active := [s for s, r in enumerate(wave) if len(toks[s]) < r.new_tokens]:
            lens = [len(wave[s].prompt) + len(toks[s]) for s in active]  # with the new token
            step = kv.step(True, active, lens, 1)
            last = forward(model, step, [[toks[s][-1]] for s in active], [n - 1 for n in lens])
            for row, s in enumerate(active):
                logits[s].append(last[row])
                toks[s].append(int(last[row].argmax()))
        results += [(t, torch.stack(lg)) for t, lg in zip(toks, logits, strict=True)]
    return results


def reference(model, requests: list[Request]) -> list[tuple]:
    """The same requests through transformers' ``generate`` (greedy, SDPA, its
    own dynamic KV cache), one at a time: ``(tokens, logits [new_tokens, vocab])``."""
    results = []
    for r in requests:
        ids = torch.tensor([r.prompt], device=model.device)
        g = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=r.new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        results.append((g.sequences[0, ids.shape[1] :].tolist(), torch.stack(g.logits)[:, 0]))
    return results


def compare(paged: list[tuple], ref: list[tuple]) -> dict:
    """Greedy tokens and logits of both paths. Logits are compared up to the
    first differing token (after it the two sequences differ); a mismatch is
    reported with its position and each path's logit gap between the two tokens."""
    mismatches, max_diff = [], 0.0
    for i, ((tp, lp), (tr, lr)) in enumerate(zip(paged, ref, strict=True)):
        same = next((j for j, (a, b) in enumerate(zip(tp, tr, strict=True)) if a != b), len(tp))
        n = min(same + 1, len(tp))
        max_diff = max(max_diff, float((lp[:n].float() - lr[:n].float()).abs().max()))
        if same < len(tp):
            a, b = tp[same], tr[same]
            mismatches.append(
                {
                    "request": i,
                    "position": same,
                    "paged_token": a,
                    "sdpa_token": b,
                    "paged_logit_gap": float(lp[same, a] - lp[same, b]),
                    "sdpa_logit_gap": float(lr[same, b] - lr[same, a]),
                }
            )
    return {"identical": not mismatches, "mismatches": mismatches, "max_logit_diff": max_diff}


def load(cfg, cache_dir, warm: bool):
    """``load_plan``; with ``warm``, a plan with missing variants is first warmed
    by ``kernel-cache warmup`` in a child process (this one never compiles).

    Raises: MissingVariantsError without ``warm`` (it names the warmup command);
        KernelCacheError when the warmup fails.
    """
    try:
        return load_plan(cfg, cache_dir)
    except MissingVariantsError as e:
        if not warm:
            raise
        args = shlex.split(config_to_cli(cfg, cache_dir))
        print(f"{len(e.missing)} variant(s) missing; running: {e.command}", file=sys.stderr)
        cmd = [sys.executable, "-m", "warmup.cli.main", "warmup", *args]
        if subprocess.run(cmd).returncode != 0:
            raise KernelCacheError(f"warmup failed: {e.command}") from None
        return load_plan(cfg, cache_dir)


def timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


def run(args) -> dict:
    cfg, cache_dir = config_from_args(args), cache_dir_of(args)
    check_trace(args.trace)
    requests = make_requests(
        args.trace, args.requests, args.start, cfg.max_model_len, args.max_new_tokens
    )
    if not requests:
        raise KernelCacheError(
            f"trace {args.trace}: no rows from --start {args.start} (nothing to serve)"
        )
    rt = load(cfg, cache_dir, args.warmup)
    chunk = args.prefill_chunk or rt.bucketer.max_query
    if not 1 <= chunk <= rt.bucketer.max_query:
        raise KernelCacheError(
            f"--prefill-chunk {chunk}: must be between 1 and the plan's largest query bucket "
            f"{rt.bucketer.max_query} (min(max_num_batched_tokens, max_model_len))"
        )
    paged_model, ref_model = build_models(cfg, args.layers)
    kv = PagedKV(rt, args.layers)
    with torch.inference_mode():
        for _ in range(args.untimed):  # first calls pay one-time costs in torch and the runtime
            serve(paged_model, kv, requests, chunk)
            reference(ref_model, requests)
        before = rt.stats()["calls"]
        paged, t_paged = timed(serve, paged_model, kv, requests, chunk)
        ref, t_ref = timed(reference, ref_model, requests)
    new = sum(r.new_tokens for r in requests)
    stats = rt.stats()
    calls = {v: n - before.get(v, 0) for v, n in stats["calls"].items() if n > before.get(v, 0)}
    return {
        "model": cfg.model,
        "layers": args.layers,
        "dtype": cfg.dtype,
        "device": cfg.device,
        "prefill_chunk": chunk,
        "requests": [
            {"row": r.row, "prompt_tokens": len(r.prompt), "new_tokens": r.new_tokens}
            for r in requests
        ],
        "notes": [r.note for r in requests if r.note],
        "new_tokens": new,
        "paged": {"seconds": round(t_paged, 3), "tokens_per_s": round(new / t_paged, 1)},
        "sdpa": {"seconds": round(t_ref, 3), "tokens_per_s": round(new / t_ref, 1)},
        **compare(paged, ref),
        "compiles": stats["compiles"],
        "compile_stack_imported": stats["compile_stack_imported"],
        "calls_per_variant": calls,  # of the timed pass
        "load_seconds": stats["load_seconds"],
    }


def print_report(rep: dict) -> None:
    print(
        f"{rep['model']}: {rep['layers']} layers, {rep['dtype']} on {rep['device']}, "
        f"{len(rep['requests'])} requests, prefill chunks of {rep['prefill_chunk']} tokens"
    )
    for note in rep["notes"]:
        print(f"  note: {note}")
    for name, label in (("paged", "kernel cache (paged KV)"), ("sdpa", "transformers SDPA")):
        p = rep[name]
        print(
            f"{label:24s} {rep['new_tokens']} tokens in {p['seconds']:.2f} s: "
            f"{p['tokens_per_s']:.1f} tokens/s"
        )
    verdict = "identical" if rep["identical"] else f"{len(rep['mismatches'])} request(s) differ"
    print(f"greedy tokens: {verdict}; max logit difference {rep['max_logit_diff']:.2e}")
    for m in rep["mismatches"]:
        print(
            f"  request {m['request']}: first difference at output token {m['position']} "
            f"(paged {m['paged_token']}, sdpa {m['sdpa_token']}); logit gap there: paged "
            f"{m['paged_logit_gap']:.2e}, sdpa {m['sdpa_logit_gap']:.2e}"
        )
    print("kernel calls per variant:")
    for v, n in rep["calls_per_variant"].items():
        print(f"  {v:32s} {n:7d}")
    print(f"compiles: {rep['compiles']}")


def _at_least(low: int):
    """An argparse type: an int >= ``low`` (a 0 or negative count would serve
    nothing and report a vacuous match)."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if n < low:
            raise argparse.ArgumentTypeError(f"{n}: must be at least {low}")
        return n

    return parse


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    engine_options(p)
    p.add_argument("--cache-dir", default=None, metavar="DIR", help=CACHE_DIR_HELP)
    p.add_argument(
        "--warmup", action="store_true", help="warm missing variants first (kernel-cache warmup)"
    )
    p.add_argument("--layers", type=_at_least(1), default=2, help="decoder layers (default 2)")
    p.add_argument("--requests", type=_at_least(1), default=4, help="requests to serve (default 4)")
    p.add_argument("--start", type=_at_least(0), default=0, help="first row of the trace")
    p.add_argument(
        "--max-new-tokens", type=_at_least(1), default=None, metavar="N", help="clip outputs"
    )
    p.add_argument(
        "--prefill-chunk",
        type=_at_least(1),
        default=None,
        metavar="N",
        help="prompt tokens per prefill call (default: the plan's largest query bucket)",
    )
    p.add_argument(
        "--trace",
        default=str(DEFAULT_TRACE),
        metavar="CSV",
        help=f"request lengths (default {TRACE_IN_REPO} relative to the repository: "
        f"{TRACE_SOURCE})",
    )
    p.add_argument(
        "--untimed",
        type=_at_least(0),
        default=1,
        metavar="N",
        help="untimed passes of both paths before the timed one (default 1)",
    )
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("hf_generate: error: needs transformers: pip install -e '.[hf]'", file=sys.stderr)
        return 2
    try:
        rep = run(args)
    except MissingVariantsError as e:
        print(f"hf_generate: error: {e}\n(or rerun with --warmup)", file=sys.stderr)
        return 2
    except KernelCacheError as e:
        print(f"hf_generate: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(rep, indent=2))
    else:
        print_report(rep)
    return 0 if rep["identical"] and rep["compiles"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
