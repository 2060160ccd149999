"""Dispatch's argument checks, which run before any kernel (no compile: an empty
runtime; every call here is refused before a variant is looked up)."""

import pytest
import torch

from kernel_cache import Bucketer, ShapeError, make_config
from kernel_cache.runtime.dispatch import AttentionRuntime

CFG = make_config(
    "llama-3.2-1b", max_model_len=128, block_size=64, max_num_seqs=4, max_num_batched_tokens=128
)
KC = torch.zeros(3, 64, 8, 64)


def runtime():
    return AttentionRuntime(CFG, Bucketer(CFG), {})


@pytest.mark.parametrize("value", [True, False])
def test_prefill_refuses_a_bool_length(value):
    with pytest.raises(ShapeError, match=f"seq_len {value} is a bool; expected an int"):
        runtime().prefill(torch.zeros(1, 32, 64), KC, KC, torch.zeros(2, dtype=torch.int32), value)


@pytest.mark.parametrize("lens", [[True], [5, True], [False, 7]])
def test_decode_refuses_a_bool_length(lens):
    q = torch.zeros(len(lens), 32, 64)
    bt = torch.zeros(len(lens), 2, dtype=torch.int32)
    bad = next(n for n in lens if isinstance(n, bool))
    with pytest.raises(ShapeError, match=f"seq_lens holds {bad}, a bool; expected ints"):
        runtime().decode(q, KC, KC, bt, lens)


def test_over_length_messages_say_how_to_warm_a_larger_plan():
    rt = runtime()
    with pytest.raises(
        ShapeError, match="seq_len 129 is above max_model_len 128; raise --max-model-len and warm"
    ):
        rt.prefill(torch.zeros(1, 32, 64), KC, KC, torch.zeros(3, dtype=torch.int32), 129)
    with pytest.raises(
        ShapeError, match="seq_len 129 is above max_model_len 128; raise --max-model-len and warm"
    ):
        rt.decode(torch.zeros(1, 32, 64), KC, KC, torch.zeros(1, 3, dtype=torch.int32), [129])
    with pytest.raises(
        ShapeError, match="num_seqs 5 is above max_num_seqs 4; raise --max-num-seqs and warm"
    ):
        rt.decode(torch.zeros(5, 32, 64), KC, KC, torch.zeros(5, 1, dtype=torch.int32), [1] * 5)


def _layout_changes():
    """In-place changes of a pool tensor the engine keeps passing: each must be
    checked again, not skipped as "the same objects as last call"."""

    def to_half(t):
        t.data = t.data.half()  # what nn.Module.to does to a parameter

    def strided(t):
        t.data = torch.zeros(6, 64, 8, 64)[::2]

    def shrink(t):
        t.resize_(1, 64, 8, 64)

    def shrink_storage(t):
        t.untyped_storage().resize_(16)

    return [
        (to_half, "is torch.float16"),
        (strided, "is not contiguous"),
        (shrink, "key_cache has 3 pool blocks and value_cache 1"),
        (shrink_storage, "value_cache's storage holds 16 bytes, fewer than its sizes"),
    ]


@pytest.mark.parametrize(
    "change,message",
    _layout_changes(),
    ids=["data-to-half", "data-strided", "resize", "storage-shrunk"],
)
def test_a_pool_changed_in_place_since_the_last_call_is_checked_again(change, message):
    rt = runtime()
    q = torch.zeros(1, 32, 64)
    kc, vc = torch.zeros(3, 64, 8, 64), torch.zeros(3, 64, 8, 64)
    rt._check(q, kc, vc)
    rt._check(q, kc, vc)  # the same objects, unchanged: passes again
    change(vc)
    with pytest.raises(ShapeError, match=message):
        rt._check(q, kc, vc)


def test_a_pool_whose_storage_is_smaller_than_its_sizes_is_refused():
    """A tensor whose storage was shrunk under it: the kernels would read past the
    end of its memory (torch's own ops refuse it too)."""
    kc = torch.zeros(3, 64, 8, 64)
    kc.untyped_storage().resize_(16)
    with pytest.raises(ShapeError, match="key_cache's storage holds 16 bytes"):
        runtime()._check(torch.zeros(1, 32, 64), kc, torch.zeros(3, 64, 8, 64))


def test_a_storage_shrunk_in_place_at_the_same_address_is_checked_again():
    """The storage of a pool already checked is resized under it: even where the
    allocator hands back the same address, the size differs and the checks run."""
    rt = runtime()
    q = torch.zeros(1, 32, 64)
    kc, vc = torch.zeros(3, 64, 8, 64), torch.zeros(3, 64, 8, 64)
    rt._check(q, kc, vc)
    ok = rt._kv_ok
    kc.untyped_storage().resize_(16)
    # What the checked layout would be had the allocator returned the same address
    # (it does at times): only the storage's size tells the two apart.
    rt._kv_ok = (ok[0], ok[1], (kc.data_ptr(), *ok[2][1:]), ok[3])
    with pytest.raises(ShapeError, match="key_cache's storage holds 16 bytes"):
        rt._check(q, kc, vc)


def test_a_negated_view_of_the_pool_is_refused():
    with pytest.raises(ShapeError, match="key_cache is a negated or conjugated view"):
        runtime()._check(torch.zeros(1, 32, 64), torch._neg_view(torch.zeros(3, 64, 8, 64)),
                         torch.zeros(3, 64, 8, 64))  # fmt: skip
