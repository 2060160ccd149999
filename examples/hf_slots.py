"""Serve hf_generate.py's Llama with its MLPs and RMSNorms as declared slots.

    python examples/hf_slots.py [--cache-dir DIR]

Needs transformers (``pip install -e '.[hf]'``). The model is the one
``hf_generate.py`` builds (:func:`hf_generate.build_models`: a random-weight
``LlamaForCausalLM``, attention through the plan's ``prefill`` and ``decode``
over a paged KV cache), here with llama-3.2-1b's attention geometry (hidden
size 2048, intermediate size 4096), 2 decoder layers and a tiny plan
(:data:`LIMITS`). Each layer's ``LlamaMLP``, both its ``LlamaRMSNorm`` modules
and the final norm run as two declared slots (``llama_mlp``,
``llama_rms_norm``: ``[query_tokens, 2048]`` rows in and out), their weights
passed at each call (``runtime.prepare`` once per module, then
``runtime.call``). Plan variants missing from the cache are warmed first by
``kernel-cache warmup`` in a child process (this process never compiles; a
cold cache, 4 variants, takes about a minute on 2 cores).

Prints whether the greedy tokens of 4 Azure-trace requests equal transformers'
own eager generation (SDPA attention, its MLP and norms); the compiles after
warmup, counted by torch's Inductor counter (this process, from its start)
and by an audit hook on process starts while serving (a compile runs the C++
compiler), not by the runtime's report; and the slots' artifact bytes against
the bytes of the weights they run. Exit status 0 when the tokens are
identical and nothing compiled, 1 otherwise, 2 on an error.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from hf_generate import PagedKV, build_models, compare, load, make_requests, reference, serve
from replay_trace import DEFAULT_TRACE, check_trace  # this folder, as hf_generate's own

from kernel_cache import make_config
from kernel_cache.errors import KernelCacheError
from kernel_cache.plan.plan import Plan
from kernel_cache.store.disk_tier import DiskTier
from warmup.cli.options import CACHE_DIR_HELP, cache_dir_of

MODEL = "llama-3.2-1b"
LIMITS = {
    "max_model_len": 32,
    "block_size": 16,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 32,
    "kv_buckets": (32,),
    "query_buckets": (32,),
}  # one query bucket (prompts run in chunks of 32), one KV bucket, one decode batch of 4:
#  prefill, decode and the two slots at 32 rows, 4 variants in all
LAYERS, REQUESTS = 2, 4
EPS = 1e-6  # LlamaConfig's rms_norm_eps, which build_models keeps
MLP, NORM = "llama_mlp", "llama_rms_norm"
#: Audit events of a process start (Inductor runs the C++ compiler through subprocess).
STARTS = ("subprocess.Popen", "os.posix_spawn", "os.exec", "os.system", "os.fork")


def make_mlp(hidden: int, inter: int):
    """transformers' ``LlamaMLP`` (SiLU, no bias): ``[tokens, hidden] -> [tokens, hidden]``."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    return LlamaMLP(LlamaConfig(hidden_size=hidden, intermediate_size=inter))


def make_norm(hidden: int, eps: float):
    """transformers' ``LlamaRMSNorm``: ``[tokens, hidden] -> [tokens, hidden]``."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return LlamaRMSNorm(hidden, eps=eps)


def plan_config():
    """The engine config: :data:`MODEL`'s geometry, :data:`LIMITS`, both slots."""
    base = make_config(MODEL, **LIMITS)
    hidden = base.num_heads * base.head_dim
    rows = {
        "inputs": [{"name": "x", "shape": ["query_tokens", hidden], "dtype": base.dtype}],
        "output_rows": "query_tokens",
    }
    mlp = {
        "name": MLP,
        "factory": "hf_slots:make_mlp",
        "args": {"hidden": hidden, "inter": 2 * hidden},
    }
    norm = {"name": NORM, "factory": "hf_slots:make_norm", "args": {"hidden": hidden, "eps": EPS}}
    return make_config(MODEL, **LIMITS, slots=[{**mlp, **rows}, {**norm, **rows}])


class SlotCall(torch.nn.Module):
    """A module of the model run as declared slot ``slot``: ``x [..., hidden]``
    as rows ``[tokens, hidden]``, with ``module``'s weights (checked once here)."""

    def __init__(self, rt, slot: str, module: torch.nn.Module):
        super().__init__()
        self.rt, self.slot, self.weights = rt, slot, rt.prepare(slot, module)

    def forward(self, x):
        rows = x.reshape(-1, x.shape[-1])
        return self.rt.call(self.slot, rows, weights=self.weights).view(x.shape)


def to_slots(model, rt) -> dict[str, list[int]]:
    """Swap ``model``'s MLPs and RMSNorms for :class:`SlotCall`s; ``{slot: [bytes
    of each swapped module's weights]}``."""
    nbytes: dict[str, list[int]] = {MLP: [], NORM: []}

    def swap(owner, name, slot):
        module = getattr(owner, name)
        if getattr(module, "variance_epsilon", EPS) != EPS:
            raise KernelCacheError(f"{name}: eps {module.variance_epsilon}, the slot's is {EPS}")
        nbytes[slot].append(sum(p.numel() * p.element_size() for p in module.parameters()))
        setattr(owner, name, SlotCall(rt, slot, module))

    for layer in model.model.layers:
        swap(layer, "mlp", MLP)
        swap(layer, "input_layernorm", NORM)
        swap(layer, "post_attention_layernorm", NORM)
    swap(model.model, "norm", NORM)
    return nbytes


def artifact_bytes(cfg, cache_dir) -> dict[str, int]:
    """``{variant: bytes of its artifact file}`` of the declared slots' variants."""
    tier = DiskTier(cache_dir, read_only=True)
    try:
        return {
            str(item.variant): tier.artifact_path(item.key.hexdigest).stat().st_size
            for item in Plan.build(cfg).items
            if item.variant.kernel in (MLP, NORM)
        }
    finally:
        tier.close()


def inductor_compiles() -> int:
    """Inductor graph compiles in this process, from torch's own counter (none
    where torch's compile stack is not imported)."""
    utils = sys.modules.get("torch._dynamo.utils")
    return 0 if utils is None else len(utils.compilation_time_metrics.get("compile_fx_inner", []))


def run(cache_dir) -> dict:
    check_trace(DEFAULT_TRACE)
    cfg = plan_config()
    here = str(Path(__file__).resolve().parent)  # the warmup child imports hf_slots from here
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    rt = load(cfg, cache_dir, warm=True)
    requests = make_requests(DEFAULT_TRACE, REQUESTS, 0, cfg.max_model_len)
    paged_model, ref_model = build_models(cfg, LAYERS)
    weights = to_slots(paged_model, rt)
    artifacts = artifact_bytes(cfg, cache_dir)
    started = []  # processes started from here on: a compile runs the C++ compiler
    sys.addaudithook(lambda ev, args: ev in STARTS and started.append(args))
    with torch.inference_mode():
        paged = serve(paged_model, PagedKV(rt, LAYERS), requests, rt.bucketer.max_query)
        ref = reference(ref_model, requests)
    calls = rt.stats()["calls"]
    return {
        **compare(paged, ref),
        "compiles": inductor_compiles(),
        "processes_started": len(started),
        "slot_calls": {v: n for v, n in calls.items() if v.split(":")[0] in (MLP, NORM)},
        "artifact_bytes": artifacts,
        "weight_bytes": weights,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache-dir", default=None, metavar="DIR", help=CACHE_DIR_HELP)
    args = p.parse_args(argv)
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("hf_slots: error: needs transformers: pip install -e '.[hf]'", file=sys.stderr)
        return 2
    try:
        rep = run(cache_dir_of(args))
    except KernelCacheError as e:
        print(f"hf_slots: error: {e}", file=sys.stderr)
        return 2
    print(f"{MODEL} geometry, {LAYERS} layers, {REQUESTS} requests; MLP and RMSNorm as slots")
    verdict = "identical" if rep["identical"] else f"{len(rep['mismatches'])} request(s) differ"
    print(f"greedy tokens vs transformers' eager generate: {verdict} ", end="")
    print(f"(max logit difference {rep['max_logit_diff']:.2e})")
    print(f"compiles after warmup: {rep['compiles']} (torch's Inductor counter); ", end="")
    print(f"processes started while serving: {rep['processes_started']}")
    print(f"{'slot variant':24s} {'calls':>6s} {'artifact bytes':>15s}")
    for v, size in rep["artifact_bytes"].items():
        print(f"{v:24s} {rep['slot_calls'].get(v, 0):6d} {size:15d}")
    for slot, sizes in rep["weight_bytes"].items():
        print(f"weights of {slot}: {len(sizes)} modules of {sizes[0]} bytes")
    art, w = sum(rep["artifact_bytes"].values()), sum(map(sum, rep["weight_bytes"].values()))
    print(f"artifacts {art} bytes in all for {w} bytes of weights ({w / art:.0f}x the artifacts)")
    ok = rep["identical"] and rep["compiles"] == 0 and rep["processes_started"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
