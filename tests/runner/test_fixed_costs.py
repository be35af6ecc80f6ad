"""The main job's cheaper fixed costs compute exactly what the plain formulas compute.

error_metrics forms each intermediate once and takes the percentiles with one partition
(metrics.abs_percentiles): every field must equal, bit for bit, the single metric functions
(the plain formulas) and np.percentile's default "linear" method.
"""
import math

import numpy as np
import pytest

from harness.metrics.errors import METRICS, abs_percentiles, error_metrics, max_abs


def _same(x: float, y: float) -> bool:
    return (math.isnan(x) and math.isnan(y)) or x == y


def _arrays():
    rng = np.random.default_rng(7)
    for n in (1, 2, 3, 4, 5, 6, 10, 11, 99, 100, 101, 1000, 1001, 4097):
        yield np.abs(rng.standard_normal(n))
        yield rng.integers(0, 3, n).astype(np.float64)          # heavy ties, zeros
        yield np.full(n, 0.1)                                     # all equal
        yield np.abs(rng.standard_normal(n) * 10.0 ** rng.integers(-310, 300, n))  # subnormal to huge
    yield np.array([0.0, -0.0, 5e-324, 1.7976931348623157e308])
    yield np.abs(rng.standard_normal(512 * 96)).astype(np.float32).astype(np.float64)
    channels = np.abs(rng.standard_normal(768)) * 10.0 ** rng.integers(-3, 3, 768)  # per-channel scales, (1, 512, 768)
    yield (np.abs(rng.standard_normal((512, 768))) * channels).reshape(-1)
    yield np.round(np.abs(rng.standard_normal(3 * 2 ** 15)) * 8) / 8            # large, heavy ties
    yield np.r_[np.zeros(2 ** 15), np.abs(rng.standard_normal(2 ** 14 + 3))]      # half zeros


def test_abs_percentiles_equal_numpy_percentile():
    for values in _arrays():
        want = np.percentile(values, [50, 90, 99])
        got = abs_percentiles(np.abs(values).copy())
        assert [float(w) for w in want] == list(got), (values.size, want, got)


def test_order_stats_fall_back_when_the_sample_misleads():
    from harness.metrics.percentiles import _order_stats

    values = np.arange(1, 2 ** 15 + 1, dtype=np.float64)
    values[::17] = 0.0  # every sampled element (step 17 for this size) is 0: the brackets miss
    keys = values.copy().view(np.int64)
    assert _order_stats(keys, [100, 16383, 16384]) is None
    assert list(abs_percentiles(values.copy())) == [float(v) for v in np.percentile(values, [50, 90, 99])]
    sample_ok = np.abs(np.random.default_rng(3).standard_normal(2 ** 15))
    got = _order_stats(sample_ok.copy().view(np.int64), [5, 6, 16383, 32766, 32767])
    assert got == {r: int(v) for r, v in zip([5, 6, 16383, 32766, 32767],
                                             np.sort(sample_ok).view(np.int64)[[5, 6, 16383, 32766, 32767]])}


def _pairs():
    rng = np.random.default_rng(11)
    for shape in [(1,), (2,), (3, 5), (1, 64, 48), (2, 33, 17), (1, 512, 96)]:
        ref = rng.standard_normal(shape).astype(np.float32)
        yield ref, (ref + 0.01 * rng.standard_normal(shape)).astype(np.float32)
        yield ref, np.round(ref * 4).astype(np.float32) / 4                         # ties in |d|
        yield ref.astype(np.float16), (ref + 0.1).astype(np.float16)
        yield ref.astype(np.float64), ref.astype(np.float64)                         # d = 0
        yield np.zeros(shape, np.float32), ref                                       # zero reference
        yield np.full(shape, 2.0, np.float32), ref                                   # constant reference
    big = rng.standard_normal((40, 30)).astype(np.float32)
    yield big.T, (big + 0.5 * rng.standard_normal(big.shape)).astype(np.float32).T   # F-ordered inputs
    yield big[:, ::3], big[:, 1::3]                                                  # strided views
    yield rng.integers(-5, 5, (4, 9)).astype(np.int8), rng.integers(-5, 5, (4, 9)).astype(np.int8)


def test_error_metrics_equal_the_single_formulas_bit_for_bit():
    for ref, test in _pairs():
        row = error_metrics(ref, test)
        for name, fn in METRICS.items():
            assert _same(row[name], fn(ref, test)), (name, ref.shape, ref.dtype, row[name], fn(ref, test))
        assert (row["max_abs"], row["max_abs_index"]) == max_abs(ref, test)
        d = np.abs(test.astype(np.float64) - ref.astype(np.float64))
        assert [row["p50"], row["p90"], row["p99"]] == [float(v) for v in np.percentile(d, [50, 90, 99])]


def test_error_metrics_leaves_its_inputs_alone():
    ref = np.random.default_rng(1).standard_normal((3, 50)).astype(np.float64)
    test = ref[::-1].copy()
    before = (ref.copy(), test.copy())
    error_metrics(ref, test)
    assert np.array_equal(ref, before[0]) and np.array_equal(test, before[1])


@pytest.mark.parametrize("shape", [(1, 7, 5), (2, 3, 4, 5), (1, 512, 768), (3, 1001, 7)])
def test_sum_of_a_contiguous_array_is_the_sum_of_its_flat_view(shape):
    """error_metrics reuses sum(d * d) for the sqnr, which sums the flattened d: the same order for C-contiguous d."""
    x = np.random.default_rng(3).standard_normal(shape) * 10.0 ** np.random.default_rng(4).integers(-8, 8, shape)
    assert float(np.sum(x * x)) == float(np.sum(x.reshape(-1) * x.reshape(-1)))


def test_compare_modes_compares_each_pair_once_with_the_same_answers(monkeypatch):
    import harness.metrics.compare as compare

    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, 6, 4)).astype(np.float32)
    y = rng.standard_normal((1, 6, 4)).astype(np.float32)
    arrays = {"ref": {"input": x, "output": y, "residual": x + y},
              "same": {"input": x.copy(), "output": y.copy(), "residual": x + y},        # identical to ref
              "out": {"input": x.copy(), "output": y + 1, "residual": x + y},            # output differs only
              "in": {"input": x + 1, "output": y + 1, "residual": x + y + 2}}            # its input differs
    calls = []
    real = compare._equal
    monkeypatch.setattr(compare, "_equal", lambda a, b: calls.append(1) or real(a, b))
    out = compare.compare_modes({m: list(a) for m, a in arrays.items()}, lambda m, t: arrays[m][t], "ref")
    for mode in ("same", "out", "in"):
        for tensor, row in out["modes"][mode].items():
            assert row["identical"] == bool(np.array_equal(arrays["ref"][tensor], arrays[mode][tensor]))
            assert row["input_differs"] == (not np.array_equal(arrays["ref"]["input"], arrays[mode]["input"]))
    assert out["identical_groups"] == [["ref", "same"]]
    # 3 modes x 3 tensors against the reference, then identical_groups: same vs ref again (memoized); out
    # and in hash differently from every group's first mode, so they are never compared with it
    assert len(calls) == 9


@pytest.mark.parametrize("extra", [-36045 + 512, -1, 0, 1, 9000])
def test_sample_tokenized_one_document_at_a_time_has_the_same_ids(extra):
    """read_sample encodes only the documents it needs, one at a time; the ids are the first seq_len of
    the whole file's stream (documents encoded two at a time, joined by end-of-text)."""
    from conftest import SHIPPED
    from harness.checkpoints.text import DEFAULT_TEXT_FILE, read_sample, tokenize_file
    from harness.checkpoints.tokenizer import load_tokenizer

    tok = load_tokenizer(SHIPPED)
    stream = tokenize_file(tok, DEFAULT_TEXT_FILE)
    first = len(tok.encode_documents([json_text(DEFAULT_TEXT_FILE, 0)])[0]) + 1  # + end-of-text
    assert first == 36045
    seq_len = first + extra
    encoded = []
    real = tok.encode_documents
    tok.encode_documents = lambda docs: encoded.append(len(docs)) or real(docs)
    sample = read_sample(tok, DEFAULT_TEXT_FILE, seq_len)
    assert sample.ids.tolist() == [stream[:seq_len].tolist()]
    assert sample.documents_used == (1 if seq_len <= first else 2) == len(encoded) and set(encoded) == {1}


def json_text(path, n):
    import json
    return json.loads(path.read_text().splitlines()[n])["text"]


@pytest.mark.parametrize("compress", [False, True])
def test_npz_hash_taken_behind_the_writer_is_the_files(tmp_path, compress):
    """PairWriter hashes finished members in a worker thread while it writes; the sha256 in the manifest is
    still file_sha256 of the .npz on disk, and load_capture accepts the pair."""
    from harness.store.files import TrailingSha256, file_sha256
    from harness.store.format import PairWriter
    from harness.store.reader import load_capture

    rng = np.random.default_rng(2)
    arrays = {f"mode_{m}_{t}": rng.standard_normal((1, 300, 70)).astype(np.float32)
              for m in ("fp32", "0") for t in ("input", "output")}
    arrays["mode_0__L0.ssm.u"] = arrays["mode_fp32_input"]  # deduplicated: never written
    out = tmp_path / "c.npz"
    with PairWriter(out, compress, dedup=True) as writer:
        for key, arr in arrays.items():
            writer.add(key, arr)
        stats = writer.commit({"schema_version": 2, "modes": {}})
    assert stats["npz"]["sha256"] == file_sha256(out) and stats["npz"]["bytes"] == out.stat().st_size
    assert load_capture(out).manifest["npz"]["sha256"] == file_sha256(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.npz", "c_stats.json"]  # no temporary left

    part = tmp_path / "part.bin"  # regions declared final in several steps, out of step with the reads
    data = rng.integers(0, 256, 3_000_001, dtype=np.uint8).tobytes()
    part.write_bytes(data)
    h = TrailingSha256(part)
    for end in (0, 1, 1 << 20, (1 << 20) + 5, 2_999_999):
        h.final(end)
    assert h.hexdigest() == file_sha256(part)
    h.close()


@pytest.mark.parametrize("n", [1, 7, 8, 129, 1000, 4097, 65536 + 3, 1 << 20])
@pytest.mark.parametrize("leaf", [8, 100, 1024])
def test_chunked_sums_equal_numpy_sum_bit_for_bit(n, leaf, monkeypatch):
    """_tree combines the leaves' sums in numpy's pairwise order: the total equals np.sum over the whole
    array (values spread over many magnitudes, so another order would show in the last bits)."""
    from harness.metrics import errors as metrics

    monkeypatch.setattr(metrics, "_LEAF", leaf)
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n) * np.exp(rng.standard_normal(n) * 6)
    (got,) = metrics._tree(0, n, lambda lo, hi: [np.sum(x[lo:hi])])
    assert got == np.sum(x) and got / n == np.mean(x)
    assert np.mean(x.reshape(-1, 1)) == np.mean(x)   # the N-D mean of a contiguous array: the same sum


def _stats_by_formula(v: np.ndarray) -> dict:
    v64 = v.astype(np.float64).reshape(-1)
    return {"mean": float(v64.mean()), "std": float(np.sqrt(np.mean(np.square(v64 - v64.mean())))),
            "l2": float(np.sqrt(np.sum(v64 * v64))), "first_10": v64[:10].tolist()}


@pytest.mark.parametrize("leaf", [1000, 1 << 18])
def test_metrics_of_arrays_seen_in_chunks_equal_the_single_formulas(leaf, monkeypatch):
    """Arrays of several chunks (a small leaf, or the default one with 2**20 + values, as the logits):
    every metric, the percentiles and the stats equal the whole-array formulas bit for bit."""
    from harness.metrics import errors as metrics
    from harness.metrics.errors import tensor_stats

    monkeypatch.setattr(metrics, "_LEAF", leaf)
    rng = np.random.default_rng(5)
    shape = (1, 64, 96) if leaf < 1 << 18 else (1, 37, 30011)
    ref = (rng.standard_normal(shape) * np.exp(rng.standard_normal(shape[-1]) * 3)).astype(np.float32)
    pairs = [(ref, (ref + 0.01 * rng.standard_normal(shape)).astype(np.float32)),
             (ref, np.round(ref * 4).astype(np.float32) / 4),
             (ref[0].T, (ref[0] + 0.5).astype(np.float32).T)]
    for r, t in pairs:
        row = error_metrics(r, t)
        for name, fn in METRICS.items():
            assert _same(row[name], fn(r, t)), (leaf, name, row[name], fn(r, t))
        assert (row["max_abs"], row["max_abs_index"]) == max_abs(r, t)
        d = np.abs(t.astype(np.float64) - r.astype(np.float64))
        assert [row["p50"], row["p90"], row["p99"]] == [float(v) for v in np.percentile(d, [50, 90, 99])]
        got, want = tensor_stats(t), _stats_by_formula(t)
        assert {k: got[k] for k in want} == want


def test_chunked_percentiles_fall_back_when_the_sample_misleads(monkeypatch):
    """Every sampled |d| is 0 (the differences sit off the sample's grid): the chunks' brackets miss,
    and |d| taken whole decides, still equal to np.percentile."""
    from harness.metrics import errors as metrics
    from harness.metrics.percentiles import sample_step

    monkeypatch.setattr(metrics, "_LEAF", 4096)
    n = 3 * 2 ** 15
    ref = np.zeros(n, np.float32)
    test = np.arange(1, n + 1, dtype=np.float32)
    test[::sample_step(n)] = 0.0
    row = error_metrics(ref, test)
    d = np.abs(test.astype(np.float64))
    assert [row["p50"], row["p90"], row["p99"]] == [float(v) for v in np.percentile(d, [50, 90, 99])]
