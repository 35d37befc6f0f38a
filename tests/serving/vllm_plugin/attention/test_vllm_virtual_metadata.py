"""The pieces both IHA backends (CPU and FlashAttention) share, on hand-built batches and pages: the batch in virtual
units (`attention.virtual.VirtualBatch`) and FlashAttention's view of the pages as virtual slots (`virtual_flash_cache`).
The FlashAttention backend itself imports only on a CUDA GPU (the GPU check's vllm step runs it); these run on any
vLLM build."""

import sys
from types import SimpleNamespace

import pytest
from testing_utils import REPO_ROOT


pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402

from iha.models.iha.layer_iha import IHA_FULL, IHA_SLIDING, IHALayerSpec  # noqa: E402
from iha.serving.vllm.attention.cpu import one_request_per_decoding_pseudo_query  # noqa: E402
from iha.serving.vllm.attention.virtual import (  # noqa: E402
    VirtualBatch,
    kernel_window,
    virtual_flash_cache,
    virtual_kv_spec,
)


sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
from bench_vllm_attention import PagedAttention, write_pages  # noqa: E402


BLOCK_SIZE = 32


def virtual_batch(num_pseudo_heads: int) -> VirtualBatch:
    config = SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_batched_tokens=64, max_num_seqs=4),
        compilation_config=SimpleNamespace(max_cudagraph_capture_size=8),
    )
    spec = IHALayerSpec(attention_type=IHA_FULL, num_pseudo_heads=num_pseudo_heads, sliding_window=None)
    return VirtualBatch(config, spec, torch.device("cpu"))


def batch(query_lens: list[int], seq_lens: list[int], block_table: list[list[int]], padding: int = 0, **fields):
    """A step's metadata as vLLM's runner builds it: each request's new tokens are its last `query_len` positions,
    at slot block_table[position // block_size] * block_size + position % block_size; `padding` tokens at slot -1."""
    slots = []
    for query_len, seq_len, blocks in zip(query_lens, seq_lens, block_table):
        for position in range(seq_len - query_len, seq_len):
            slots.append(blocks[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=starts.clone(),
        query_start_loc_cpu=starts,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        num_reqs=len(query_lens),
        num_actual_tokens=sum(query_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_table_tensor=torch.tensor(block_table, dtype=torch.int32),
        slot_mapping=torch.tensor(slots + [-1] * padding, dtype=torch.int64),
        seq_lens_cpu_upper_bound=torch.tensor(seq_lens, dtype=torch.int32),
        **fields,
    )


def test_a_decode_and_a_prefill_chunk_in_virtual_units():
    """One request decoding its 6th token (slot 37: block 1) and one prefilling positions 37-39 of its 40 (block 7,
    the second of its table), with a padding token, at P = 3."""
    real = batch([1, 3], [6, 40], [[1, 0], [4, 7]], padding=1)
    virtual = virtual_batch(3).of(real)
    assert virtual.query_start_loc.tolist() == [0, 3, 12]
    assert virtual.query_start_loc_cpu.tolist() == [0, 3, 12]
    assert virtual.seq_lens.tolist() == [18, 120] and virtual.seq_lens_cpu_upper_bound.tolist() == [18, 120]
    assert (virtual.num_actual_tokens, virtual.max_query_len, virtual.max_seq_len) == (12, 9, 120)
    # Pseudo-token p of the token in slot s at virtual slot 3 s + p; the padding token's three stay -1.
    assert virtual.slot_mapping.tolist() == [111, 112, 113, *range(687, 696), -1, -1, -1]
    assert virtual.block_table_tensor is real.block_table_tensor and virtual.causal is True


@pytest.mark.parametrize("num_pseudo_heads", [2, 3])
def test_kernel_addresses_and_written_slots_agree(num_pseudo_heads):
    """The kernel finds virtual position v of a request at block_table[v // (P * block_size)], offset
    v % (P * block_size), of blocks P * block_size slots long; the writer puts pseudo-token (n, p) at the virtual
    slot the metadata maps it to. For every new pseudo-token of chunks crossing block boundaries, both are the same
    slot, and the query of virtual position n * P + p is the last one its causal (bottom-right) row sees."""
    query_lens, seq_lens, block_table = [5, 1, 30], [36, 33, 64], [[2, 9], [5, 3], [8, 6]]
    real = batch(query_lens, seq_lens, block_table)
    virtual = virtual_batch(num_pseudo_heads).of(real)
    virtual_block = BLOCK_SIZE * num_pseudo_heads
    slots = virtual.slot_mapping.tolist()
    starts, lengths = virtual.query_start_loc.tolist(), virtual.seq_lens.tolist()
    checked = 0
    for request, (query_len, seq_len, blocks) in enumerate(zip(query_lens, seq_lens, block_table)):
        virtual_query_len = starts[request + 1] - starts[request]
        assert virtual_query_len == query_len * num_pseudo_heads and lengths[request] == seq_len * num_pseudo_heads
        for query in range(virtual_query_len):
            # bottom-right causal: the row of query i sees keys 0 .. seq_len - query_len + i
            last_key = lengths[request] - virtual_query_len + query
            position, pseudo = divmod(last_key, num_pseudo_heads)
            assert position == seq_len - query_len + query // num_pseudo_heads and pseudo == query % num_pseudo_heads
            kernel_slot = blocks[last_key // virtual_block] * virtual_block + last_key % virtual_block
            assert slots[starts[request] + query] == kernel_slot
            checked += 1
    assert checked == sum(query_lens) * num_pseudo_heads


def test_the_buffers_stay_where_a_cuda_graph_recorded_them():
    """Every step's virtual metadata is written into the same buffers (a captured graph replays their addresses)."""
    batches = virtual_batch(2)
    first = batches.of(batch([1, 3], [6, 40], [[1, 0], [4, 7]]))
    pointers = [first.query_start_loc.data_ptr(), first.seq_lens.data_ptr(), first.slot_mapping.data_ptr()]
    second = batches.of(batch([2], [9], [[3, 0]]))
    assert [second.query_start_loc.data_ptr(), second.seq_lens.data_ptr(), second.slot_mapping.data_ptr()] == pointers
    assert second.slot_mapping.tolist() == [3 * 64 + 14, 3 * 64 + 15, 3 * 64 + 16, 3 * 64 + 17]


def test_each_decoding_pseudo_query_is_a_request_of_its_own():
    """At P = 3: request 0 decodes (its 6th token), request 1 prefills 3 tokens, request 2 decodes its 33rd token.
    The decoding requests' pseudo-queries become requests of one query, seeing one more virtual position each."""
    virtual = virtual_batch(3).of(batch([1, 3, 1], [6, 40, 33], [[1, 0], [4, 7], [5, 3]]))
    requests = one_request_per_decoding_pseudo_query(
        virtual.query_start_loc, virtual.seq_lens, virtual.block_table_tensor, 3
    )
    assert requests.query_start_loc.tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert requests.seq_lens.tolist() == [16, 17, 18, 120, 97, 98, 99]
    assert requests.block_table.tolist() == [[1, 0]] * 3 + [[4, 7]] + [[5, 3]] * 3
    assert requests.max_query_len == 9
    assert requests.query_start_loc.dtype == requests.seq_lens.dtype == torch.int32


def test_a_batch_without_decoding_requests_stays_as_it_is():
    """Requests of 2 and 3 new tokens (speculative drafts, prefill chunks) and one of none (padding) stay whole."""
    virtual = virtual_batch(2).of(batch([2, 3, 0], [9, 40, 5], [[3, 0], [4, 7], [6, 0]]))
    requests = one_request_per_decoding_pseudo_query(
        virtual.query_start_loc, virtual.seq_lens, virtual.block_table_tensor, 2
    )
    assert torch.equal(requests.query_start_loc, virtual.query_start_loc)
    assert torch.equal(requests.seq_lens, virtual.seq_lens)
    assert torch.equal(requests.block_table, virtual.block_table_tensor)


def test_one_pseudo_head_leaves_the_batch_as_it_is():
    """At P = 1 (no pseudo-heads) a decoding request is already a request of one query."""
    virtual = virtual_batch(1).of(batch([1, 3], [6, 40], [[1, 0], [4, 7]]))
    requests = one_request_per_decoding_pseudo_query(
        virtual.query_start_loc, virtual.seq_lens, virtual.block_table_tensor, 1
    )
    assert requests.query_start_loc.tolist() == [0, 1, 4] and requests.seq_lens.tolist() == [6, 40]


# (query lengths, sequence lengths, block tables): two decoding requests around a prefill chunk; one long decoding
# request, whose keys vLLM's scheduler may split over threads (`VLLM_CPU_ATTN_SPLIT_KV`, on by default).
KERNEL_BATCHES = {
    "mixed": ([1, 3, 1], [6, 40, 33], [[1, 0], [4, 7], [5, 3]]),
    "long decode": ([1], [1500], [list(range(47))]),
}


@pytest.mark.parametrize("num_pseudo_heads", [2, 3])
@pytest.mark.parametrize("kernel_batch", list(KERNEL_BATCHES))
def test_the_kernel_computes_the_same_attention_split_or_whole(kernel_batch, num_pseudo_heads):
    """vLLM's CPU kernel on random float32 keys and values, through the plugin's schedule and kernel call: the
    decoding requests' pseudo-queries as requests of their own give the outputs of the whole requests, and both are
    softmax attention over the flat causal virtual past."""
    if not hasattr(torch.ops._C, "cpu_attention_with_kv_cache"):
        pytest.skip("vLLM's CPU attention kernel is in vLLM's CPU build only")
    generator = torch.Generator().manual_seed(0)
    num_heads, num_kv_heads, head_dim = 4, 2, 32
    virtual_block = BLOCK_SIZE * num_pseudo_heads
    query_lens, seq_lens, block_table = KERNEL_BATCHES[kernel_batch]
    real = batch(query_lens, seq_lens, block_table)
    virtual = virtual_batch(num_pseudo_heads).of(real)
    starts, lengths = virtual.query_start_loc.tolist(), virtual.seq_lens.tolist()
    num_blocks = max(max(row) for row in block_table) + 1
    key_cache = torch.zeros(num_blocks, num_kv_heads, virtual_block, head_dim)
    value_cache = torch.zeros_like(key_cache)
    past = {}  # each request's keys and values at its virtual positions
    for request, blocks in enumerate(real.block_table_tensor.tolist()):
        keys, values = (torch.randn(lengths[request], num_kv_heads, head_dim, generator=generator) for _ in "kv")
        slots = torch.tensor([blocks[v // virtual_block] * virtual_block + v % virtual_block for v in range(len(keys))])
        write_pages(keys, values, slots, key_cache, value_cache)
        past[request] = keys, values
    query = torch.randn(virtual.num_actual_tokens, num_heads, head_dim, generator=generator)
    whole = PagedAttention(
        query, key_cache, value_cache, virtual.query_start_loc, virtual.seq_lens, real.block_table_tensor
    )()
    requests = one_request_per_decoding_pseudo_query(
        virtual.query_start_loc, virtual.seq_lens, virtual.block_table_tensor, num_pseudo_heads
    )
    split = PagedAttention(
        query, key_cache, value_cache, requests.query_start_loc, requests.seq_lens, requests.block_table
    )()
    assert len(requests.seq_lens) == len(virtual.seq_lens) + query_lens.count(1) * (num_pseudo_heads - 1)
    # The reference: each virtual query against the virtual positions up to its own.
    for request, (keys, values) in past.items():
        num_queries = starts[request + 1] - starts[request]
        for query_index in range(num_queries):
            visible = lengths[request] - num_queries + query_index + 1
            row = query[starts[request] + query_index].view(num_kv_heads, -1, head_dim)
            scores = row @ keys[:visible].transpose(0, 1).transpose(1, 2) * head_dim**-0.5
            expected = (torch.softmax(scores, dim=-1) @ values[:visible].transpose(0, 1)).reshape(num_heads, head_dim)
            torch.testing.assert_close(whole[starts[request] + query_index], expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-5)


def test_a_batch_with_another_mask_is_refused():
    with pytest.raises(ValueError, match="causal decoder attention only"):
        virtual_batch(2).of(batch([1], [4], [[0, 1]], causal=False))


def pages(layout: str, num_blocks: int, num_kv_heads: int, block_size: int, width: int) -> torch.Tensor:
    """A layer's pages as vLLM hands them over: logical [blocks, kv heads, block size, width], in memory token-major
    (NHD, vLLM's default) or head-major (HND)."""
    if layout == "HND":
        return torch.zeros(num_blocks, num_kv_heads, block_size, width)
    return torch.zeros(num_blocks, block_size, num_kv_heads, width).transpose(1, 2)


@pytest.mark.parametrize(("layout", "num_kv_heads"), [("NHD", 2), ("HND", 2), ("NHD", 1)])
def test_flash_view_of_the_pages_keeps_every_virtual_block_in_its_block(layout, num_kv_heads):
    num_pseudo_heads, head_dim, block_size = 3, 4, 8
    kv_cache = pages(layout, 4, num_kv_heads, block_size, 2 * num_pseudo_heads * head_dim)
    virtual = virtual_flash_cache(kv_cache, num_pseudo_heads)
    assert virtual.shape == (4, num_kv_heads, num_pseudo_heads * block_size, 2 * head_dim)
    assert virtual.data_ptr() == kv_cache.data_ptr()
    # The keys and values as FlashAttention and the cache writer take them: [blocks, slots, kv heads, d] each.
    key_cache, value_cache = virtual.transpose(1, 2).split(head_dim, dim=-1)
    for block in range(4):
        key_cache[block].fill_(block + 1)
        value_cache[block].fill_(-(block + 1))
    # Each virtual block covers its physical block's bytes, keys and values alike, and nothing else.
    for block in range(4):
        assert kv_cache[block].abs().eq(block + 1).all()
        assert kv_cache[block].sum() == 0


def test_flash_view_of_head_major_pages_is_the_token_major_interleave():
    """Where a block is head-major, virtual slot s * P + p of head h is the p-th 2d-wide part of token s's row."""
    num_pseudo_heads, head_dim = 2, 3
    kv_cache = torch.arange(2 * 2 * 4 * 12, dtype=torch.float32).view(2, 2, 4, 12)
    virtual = virtual_flash_cache(kv_cache, num_pseudo_heads)
    for block, head, slot, pseudo in [(0, 0, 0, 0), (0, 1, 2, 1), (1, 0, 3, 0), (1, 1, 3, 1)]:
        part = kv_cache[block, head, slot, pseudo * 2 * head_dim : (pseudo + 1) * 2 * head_dim]
        assert torch.equal(virtual[block, head, slot * num_pseudo_heads + pseudo], part)


def test_pages_split_inside_a_block_are_refused():
    """A layout whose block holds several layers' pages (one layer's page is then not contiguous) is refused."""
    several_layers = torch.zeros(4, 2, 2, 8, 12)[:, 0]  # [blocks, layers, kv heads, block size, width], layer 0
    with pytest.raises(ValueError, match="read whole KV-cache blocks"):
        virtual_flash_cache(several_layers, 2)


def test_a_sliding_layers_spec_and_kernel_window_in_virtual_units():
    """A sliding IHA layer of window W = 8 at P = 3 keeps W + 1 = 9 tokens of cache (its first pseudo-query reaches
    into token n - W); the kernel sees heads of d, 3 x the block's slots and a window of W x P = 24 virtual tokens. At
    P = 1 the layer is a standard sliding layer: a cache of W tokens, a kernel window of W."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    sliding_layer = IHALayerSpec(attention_type=IHA_SLIDING, num_pseudo_heads=3, sliding_window=8)
    global_layer = IHALayerSpec(attention_type=IHA_FULL, num_pseudo_heads=3, sliding_window=None)
    shape = dict(block_size=32, num_kv_heads=2, head_size=3 * 64, dtype=torch.float32)
    sliding = virtual_kv_spec(SlidingWindowSpec(**shape, sliding_window=9), sliding_layer)
    assert (sliding.head_size, sliding.block_size, sliding.sliding_window) == (64, 96, 24)
    full = virtual_kv_spec(FullAttentionSpec(**shape), global_layer)
    assert (full.head_size, full.block_size) == (64, 96)
    assert kernel_window(9, sliding_layer) == 24 and kernel_window(None, global_layer) is None
    with pytest.raises(ValueError, match="cache window of 9 tokens for its window of 24 virtual tokens"):
        kernel_window(8, sliding_layer)  # a cache one token short of the window's reach
    with pytest.raises(ValueError, match="vLLM built it with 9"):
        kernel_window(9, global_layer)  # a global layer handed a window
    one_pseudo_head = IHALayerSpec(attention_type=IHA_SLIDING, num_pseudo_heads=1, sliding_window=8)
    assert kernel_window(8, one_pseudo_head) == 8
    unchanged = virtual_kv_spec(SlidingWindowSpec(**{**shape, "head_size": 64}, sliding_window=8), one_pseudo_head)
    assert (unchanged.head_size, unchanged.block_size, unchanged.sliding_window) == (64, 32, 8)
