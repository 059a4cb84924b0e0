"""The kvcalib vLLM plugin's packed page (exporters/vllm_slots.py): a side's stored rows (exporters/layout.py store)
packed into fixed-size per-token slots and a page's outlier pool and read back decode exactly as the codec's rows;
the per-token outlier capacity holds and is tight; a pool lets one token borrow from the page's others, and its
overflow is counted and left clamped; what the slot cannot hold is refused by field; every 2-byte field is
aligned."""
import pytest
import torch

from exporters import vllm_slots as vs
from exporters.codec import CachePolicy, Encoded, TensorPolicy, decode, encode
from exporters.layout import store

H, D, N = 3, 16, 7


def codebook(bits: int, seed: int = 0) -> torch.Tensor:
    """2^bits sorted levels in [-1, 1], the ends included (a clamped entry decodes to its bound)."""
    g = torch.Generator().manual_seed(seed)
    inner = torch.sort(torch.rand(2 ** bits - 2, generator=g) * 1.9 - 0.95).values
    return torch.cat([torch.tensor([-1.0]), inner, torch.tensor([1.0])])


def key_policy(bits: int = 4, fraction: float = 0.1, h: int = H, d: int = D) -> TensorPolicy:
    """nuq per channel with static bounds: zero / range span [lower, upper] exactly."""
    g = torch.Generator().manual_seed(1)
    upper = 1.645 * (0.5 + torch.rand(h, d, generator=g))
    lower = -1.645 * (0.5 + torch.rand(h, d, generator=g))
    bounds = {"lower": lower, "upper": upper} if fraction else {}
    return TensorPolicy(format="nuq", bits=bits, axis="channel", outlier_fraction=fraction, codebook=codebook(bits),
                        zero=(upper + lower) / 2, range=(upper - lower) / 2, **bounds)


def value_policy(bits: int = 4, fraction: float = 0.1, fmt: str = "nuq") -> TensorPolicy:
    return TensorPolicy(format=fmt, bits=bits, axis="token", outlier_fraction=fraction,
                        codebook=codebook(bits, 2) if fmt == "nuq" else None)


def kvquant_like(k: TensorPolicy | None = None, v: TensorPolicy | None = None, **cache) -> CachePolicy:
    return CachePolicy("kvquant-like", [(k or key_policy(), v or value_policy())] * 2, key_rope="pre", n_sink=1,
                       **cache)


def into_pool(tensors: dict, s: vs.SideSlot, n: int, cap: int, start: int = 0, pool: tuple | None = None):
    """n tokens of one page (one run from fill `start`) into a pool of cap entries, as the plugin places them ->
    (count, first, index [1, cap], value [1, cap], overflow)."""
    counts, idx, val = vs.outlier_lists(tensors, n)
    at = vs.pool_places(counts, torch.tensor([start] + [-1] * (n - 1)), cap)
    index, value = pool or (torch.full((1, cap), vs.SENTINEL, dtype=torch.int16),
                            torch.zeros(1, cap, dtype=torch.float16))
    keep = at["keep"]
    index[0, at["dest"][keep]] = idx[keep]
    value[0, at["dest"][keep]] = val[keep]
    return at["kept"], at["first"], index, value, at["overflow"]


def round_trip(x: torch.Tensor, p: TensorPolicy, s: vs.SideSlot, slots: torch.Tensor):
    """x [1, H, n, D] (one page of n tokens) -> (overflow, the slots' and pool's decode, the codec's own decode, the
    codec's Encoded)."""
    e = encode(x, p)
    n = x.shape[2]
    tensors = store(e, p, 0).tensors
    overflow = vs.pack_side(tensors, s, n, x.shape[1], slots)
    pooled = None
    if s.pool_rate:
        count, first, index, value, over = into_pool(tensors, s, n, s.pool_cap(n))
        overflow += over
        pooled = vs.pool_entries(count, first, torch.zeros(n, dtype=torch.int64), index, value)
    return overflow, decode(vs.unpack_side(slots, s, p, x.shape[1], x.shape[3], pooled), p), decode(e, p), e


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("vfmt", ["nuq", "uniform"])
def test_slots_decode_exactly_as_the_codec(bits, vfmt):
    k, v = key_policy(bits), value_policy(bits, fmt=vfmt)
    lay = vs.layout(kvquant_like(k, v), H, D)
    g = torch.Generator().manual_seed(bits)
    key_outliers = 0
    for _ in range(20):
        xk, xv = torch.randn(1, H, N, D, generator=g), torch.randn(1, H, N, D, generator=g) * 3
        slots = torch.zeros(N, lay.slot_bytes, dtype=torch.uint8)  # both sides in the same slots
        ok, got_k, want_k, ek = round_trip(xk, k, lay.key, slots)
        ov, got_v, want_v, ev = round_trip(xv, v, lay.value, slots)
        assert ok == 0 and ov == 0
        assert ev.n_outliers > 0  # the value side's outliers pass through the slot
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
        key_outliers += ek.n_outliers
    assert key_outliers > 0


def test_the_key_outliers_pass_through_the_slot():
    k = key_policy()
    lay = vs.layout(kvquant_like(k), H, D)
    x = torch.randn(1, H, N, D, generator=torch.Generator().manual_seed(5))
    x[0, 1, 3, 4] = 50.0
    x[0, 2, 6, 15] = -40.0
    overflow, got, want, e = round_trip(x, k, lay.key, torch.zeros(N, lay.slot_bytes, dtype=torch.uint8))
    assert overflow == 0 and e.n_outliers >= 2 and torch.equal(got, want)
    assert got[0, 1, 3, 4] == 50.0 and got[0, 2, 6, 15] == -40.0


def test_the_per_token_capacity_is_never_exceeded_and_is_tight():
    v = value_policy()
    lay = vs.layout(kvquant_like(v=v), H, D)
    assert lay.value.cap == 6  # 2 * (floor(0.05 * 47) + 1)
    g = torch.Generator().manual_seed(0)
    most = 0
    shapes = (lambda: torch.randn(1, H, N, D, generator=g),
              lambda: torch.randn(1, H, N, D, generator=g) ** 3,                       # heavy tails
              lambda: (torch.randn(1, H, N, D, generator=g) * 2).round() / 2,          # many ties
              lambda: torch.randint(0, 3, (1, H, N, D), generator=g).float(),          # few distinct values
              lambda: torch.full((1, H, N, D), 0.75))                                  # constant rows
    for i in range(300):
        x = shapes[i % len(shapes)]()
        slots = torch.zeros(N, lay.slot_bytes, dtype=torch.uint8)
        overflow, got, want, e = round_trip(x, v, lay.value, slots)
        assert overflow == 0, f"shape {i % len(shapes)}"
        assert torch.equal(got, want)
        counts = torch.bincount(e.outlier_index[:, 2], minlength=N) if e.n_outliers else torch.zeros(N)
        most = max(most, int(counts.max()))
    assert most == lay.value.cap


def test_the_per_token_capacity_counts_each_tail_as_torch_ranks_it():
    """f = 0.088 over 3 x 1417 entries: torch.quantile's float32 ranks are 187.0 and 4062.9998, so 187 entries fall
    below the lower bound and 188 above the upper one: 375, one more than 2 * (floor(0.044 * 4250) + 1)."""
    v = value_policy(fraction=0.088)
    lay = vs.layout(kvquant_like(v=v), 3, 1417)
    assert lay.value.cap == 375
    x = torch.randn(1, 3, 4, 1417, generator=torch.Generator().manual_seed(3))
    overflow, got, want, e = round_trip(x, v, lay.value, torch.zeros(4, lay.slot_bytes, dtype=torch.uint8))
    assert overflow == 0 and torch.equal(got, want)
    assert torch.bincount(e.outlier_index[:, 2], minlength=4).tolist() == [375] * 4


def test_a_token_borrows_from_its_page_pool():
    """Static bounds: no capacity per token -- one token with 30 outliers in a page whose pool holds 51 keeps them
    all (and the page's other 10), where the old per-token slot of 8 x the expected count (ceil(8 * 0.05 * 48) =
    20) clamped 10."""
    k = key_policy(fraction=0.05)
    lay = vs.layout(kvquant_like(k), H, D)
    assert lay.key.cap == 0 and lay.key.index is None and lay.key.kernel_outliers == 2
    assert lay.key.pool_cap(N) == 51 == -(-vs.POOL_SLACK * 0.05 * H * D * N // 1)   # ceil(3 * 0.05 * 48 * 7)
    x = torch.zeros(1, H, N, D)
    row4, row1 = torch.zeros(H * D), torch.zeros(H * D)
    row4[:50:5] = torch.arange(10.0) + 20                                             # token 4: 10 outliers
    row1[:30] = torch.linspace(-30, -20, 30)                                          # token 1: 30 outliers
    x[0, :, 4], x[0, :, 1] = row4.view(H, D), row1.view(H, D)
    overflow, got, want, e = round_trip(x, k, lay.key, torch.zeros(N, lay.slot_bytes, dtype=torch.uint8))
    assert e.n_outliers == 40 and overflow == 0 and torch.equal(got, want)


def test_a_page_pool_fills_in_position_order_and_continues_across_steps():
    """Tokens written in two steps (a run of 3, then one by one) fill the pool as one run would; pool_entries reads
    each token's entries back whatever page row it was given."""
    k = key_policy(fraction=0.1)
    x = torch.randn(1, H, N, D, generator=torch.Generator().manual_seed(9)) * 2
    e = encode(x, k)
    tensors = store(e, k, 0).tensors
    counts = vs.outlier_lists(tensors, N)[0]
    cap = int(counts.sum()) + 3
    whole = into_pool(tensors, None, N, cap)
    part = store(encode(x[:, :, :3], k), k, 0).tensors
    c0, f0, index, value, _ = into_pool(part, None, 3, cap)
    counts_, firsts = [c0], [f0]
    for t in range(3, N):
        one = store(encode(x[:, :, t:t + 1], k), k, 0).tensors
        start = int(firsts[-1][-1] + counts_[-1][-1])       # the previous token's first + count, as the plugin reads it
        c, f, index, value, _ = into_pool(one, None, 1, cap, start, (index, value))
        counts_.append(c)
        firsts.append(f)
    assert torch.equal(torch.cat(counts_), whole[0]) and torch.equal(torch.cat(firsts), whole[1])
    assert torch.equal(index, whole[2]) and torch.equal(value, whole[3])
    # two pages in one read: the second page's rows first
    tt, ee, vv = vs.pool_entries(torch.cat([whole[0], whole[0]]), torch.cat([whole[1], whole[1]]),
                                 torch.tensor([1] * N + [0] * N), torch.cat([index, index]), torch.cat([value, value]))
    assert tt.numel() == 2 * int(counts.sum()) and torch.equal(ee[:tt.numel() // 2], ee[tt.numel() // 2:])
    with pytest.raises(ValueError, match="within its"):
        vs.pool_entries(whole[0], whole[1] + cap, torch.zeros(N, dtype=torch.int64), index, value)


def test_pool_overflow_is_counted_and_left_clamped():
    k = key_policy(fraction=0.01)
    lay = vs.layout(kvquant_like(k), H, D)
    cap = lay.key.pool_cap(N)
    assert cap == max(2, -(-vs.POOL_SLACK * 0.01 * H * D * N // 1)) and cap < H * D
    x = torch.zeros(1, H, N, D)
    # token 2: every entry beyond its bound, alternately above and below (H * D outliers, over the capacity)
    sign = torch.tensor([1.0, -1.0]).repeat(H * D // 2).view(H, D)
    x[0, :, 2] = sign * 10 + torch.arange(H * D).view(H, D) / 100
    x[0, 1, 5, :2] = 9.0  # token 5: two outliers -- after token 2 filled the pool: clamped too
    slots = torch.zeros(N, lay.slot_bytes, dtype=torch.uint8)
    overflow, got, want, e = round_trip(x, k, lay.key, slots)
    assert overflow == H * D - cap + 2
    entries = (torch.arange(H * D) // D, torch.arange(H * D) % D)
    kept, dropped = (entries[0][:cap], entries[1][:cap]), (entries[0][cap:], entries[1][cap:])  # store's order
    row_got, row_x = got[0, :, 2], x[0, :, 2]
    assert torch.equal(row_got[kept], row_x[kept].half().float())  # kept exactly, as fp16
    dense = decode(Encoded(e.shape, codes=e.codes), k)[0, :, 2]     # the codes alone: the clamped entry coded
    assert torch.equal(row_got[dropped], dense[dropped])
    clamped = torch.minimum(torch.maximum(row_x, k.lower), k.upper)
    assert torch.allclose(row_got[dropped], clamped[dropped], atol=1e-6)
    assert not torch.allclose(row_got[dropped], row_x[dropped])
    others = torch.tensor([t for t in range(N) if t not in (2, 5)])
    assert torch.equal(got[0, :, others], want[0, :, others])  # every other token as the codec decodes it
    assert torch.allclose(got[0, 1, 5, :2], k.upper[1, :2], atol=1e-6)   # token 5's two: their bounds


def test_refusals_name_the_field():
    assert vs.refusals(kvquant_like()) == []
    assert vs.refusals(kvquant_like(residual=128)) == []       # the recent window: the plugin's rings
    for fmt, extra in (("fp16", {}), ("fp8", {"fp8_scale": torch.tensor(0.1)})):
        p = TensorPolicy(format=fmt, bits=16 if fmt == "fp16" else 8, **extra)
        lines = vs.refusals(kvquant_like(k=p))
        assert lines and lines[0].startswith(f"layers/0/key/format: allowed ('nuq', 'uniform'), got '{fmt}'")
        assert not any(line.startswith("layers/0/value") for line in lines)
    kivi = TensorPolicy(format="uniform", bits=2, axis="channel", group_size=32)
    lines = vs.refusals(kvquant_like(k=kivi))
    assert len(lines) == 2 and lines[0].startswith("layers/0/key/axis:")  # one per layer
    assert "'channel' with format 'uniform'" in lines[0]


def test_layers_of_different_bits_have_slots_of_their_own_size():
    """Per-layer bits: each layer's slot is its own size, its fields at its own offsets (vLLM holds a page per layer
    of that layer's size); padding_loss is the padding in the sizes vLLM was given (none when given their own)."""
    mixed = CachePolicy("mixed", [(key_policy(), value_policy(4)), (key_policy(), value_policy(2))], key_rope="pre")
    assert vs.refusals(mixed) == []
    h, d = 3, 64
    l0, l1 = vs.layout(mixed, h, d, 0), vs.layout(mixed, h, d, 1)
    n0, n1 = vs.natural_bytes(mixed, 0, h, d), vs.natural_bytes(mixed, 1, h, d)
    assert l0.slot_bytes == n0 and l1.slot_bytes == n1 and n0 - n1 == h * (d * 4 // 8 - d * 2 // 8)
    assert l1.value.bits == 2 and l1.value.code_bytes == d * 2 // 8 and l0.value.code_bytes == d * 4 // 8
    assert l1.value.cap == l0.value.cap and l1.key == l0.key
    natural = {0: n0, 1: n1}
    assert vs.padding_loss({0: n0, 1: n1}, natural) == 0.0
    assert vs.padding_loss({0: n0, 1: n0}, natural) == pytest.approx(1 - (n0 + n1) / (2 * n0))


def test_rotated_and_clipped_values_are_served_rotated_keys_refused(tiny, calib):
    """A rotclipv policy is a slot (the plugin encodes new value rows with the codec: the rotation and the range
    search, bytes equal; the kernel un-rotates the value sum once); a rotated or clipped key is refused by name."""
    from dataclasses import replace

    from pipeline.config import load_recipe
    from stages.recipe import build_policy

    pol = build_policy(load_recipe("kvquant-2b+sink16+recent32+rotclipv"), tiny.spec.n_layers, calib["plain"])
    assert vs.refusals(pol) == []
    k, v = pol.layers[0]
    rotk = CachePolicy("rotk", [(replace(k, rotation="hadamard"), v), (replace(k, clip="mse"), v)], key_rope="pre")
    assert [line.split(":")[0] for line in vs.refusals(rotk)] == ["layers/0/key/rotation", "layers/1/key/clip"]


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("h,d", [(1, 13), (3, 13), (3, 16), (3, 64)])
@pytest.mark.parametrize("kf,vf", [(0.0, 0.0), (0.01, 0.0), (0.0, 0.01), (0.1, 0.1)])
def test_layout_aligns_every_two_byte_field(bits, h, d, kf, vf):
    k, v = key_policy(bits, kf, h, d), value_policy(bits, vf)
    lay = vs.layout(kvquant_like(k, v), h, d)
    assert lay.slot_bytes % 2 == 0
    spans = []
    for s in (lay.key, lay.value):
        spans.append((s.codes, s.codes + h * s.code_bytes))
        assert s.code_bytes == -(-d * bits // 8)
        for name, width in (("scale", 2 * h), ("zero", 2 * h), ("index", 2 * s.cap), ("value", 2 * s.cap)):
            at = getattr(s, name)
            if at is not None:
                assert at % 2 == 0, name
                spans.append((at, at + width))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])) and spans[-1][1] <= lay.slot_bytes
    assert (lay.key.scale is None) and (lay.value.scale is not None)
    assert lay.key.cap == 0 and (lay.key.pool_rate > 0) == (kf > 0) and (lay.value.cap > 0) == (vf > 0)
    bs = 16
    pools, at = lay.pools(bs), bs * lay.slot_bytes
    if kf:   # the key pool after the slots: count, first, index, value, each 2-byte aligned, then the sink rows
        w = pools["key"]
        assert (w["count"], w["first"], w["index"]) == (at, at + 2 * bs, at + 4 * bs)
        assert w["value"] == w["index"] + 2 * w["cap"]
        assert all(w[f] % 2 == 0 for f in ("count", "first", "index", "value"))
        assert lay.sink_offset(bs) == w["value"] + 2 * w["cap"]
    assert "value" not in pools
    assert lay.page_bytes(bs) == lay.sink_offset(bs) + lay.sink_bytes


def test_the_smollm2_slot_of_kvquant_4b_1pct():
    """The slot docs/vllm.md states: kvquant-4b-1pct (keys nuq4 per channel, values nuq4 per token, 1% outliers,
    one sink row) on SmolLM2-135M (3 kv heads, head_dim 64)."""
    lay = vs.layout(kvquant_like(key_policy(4, 0.01, 3, 64), value_policy(4, 0.01)), 3, 64)
    assert (lay.key.cap, lay.value.cap) == (0, 2)  # keys: the page's pool; 2 * (floor(0.005 * 191) + 1)
    assert lay.key.pool_cap(128) == 738            # ceil(POOL_SLACK 3 * 0.01 * 192 * 128)
    assert lay.slot_bytes == 212 and lay.sink_bytes == 768
    assert lay.page_bytes(128) == 128 * 212 + 4 * 128 + 4 * 738 + 768   # 243.8 bytes per token
