"""Weight preparation caches, observer state records and document reading: details the cache files and
provenance depend on."""
import hashlib
import json

import pytest
import torch

from harness.checkpoints.text import DataError, read_documents, read_sample
from harness.checkpoints.loading import open_checkpoint
from harness.recipes.quamba.observers import MinMaxObserver, PercentileObserver
from harness.runner.weightbank import WeightBank
from harness.architectures.mamba1.weights import int8_layer


@pytest.fixture(scope="module")
def bank(hf_dir):
    return WeightBank(open_checkpoint(hf_dir))


@pytest.fixture
def own(hf_dir):
    """A bank of its own, for the tests that watch what a bank keeps."""
    return WeightBank(open_checkpoint(hf_dir))


def test_each_variant_is_prepared_once_and_shared(bank):
    a = bank.layer(0, "int8", True)
    assert bank.layer(0, "int8", True) is a
    assert bank.layer(0, "fp16", True) is not bank.layer(0, "fp16", False)
    assert bank.layer(0, "fp16", True).in_proj.shape == bank.layer(0, "fp32", True).in_proj.shape
    assert bank.raw(0) is bank.raw(0)


def test_int8_layer_quantizes_everything_but_the_norm(bank):
    fp16 = bank.layer(0, "fp16", False)
    q = int8_layer(fp16)
    assert q.norm_weight is fp16.norm_weight
    for name in ("in_proj", "conv_weight", "conv_bias", "x_proj", "dt_proj", "dt_bias", "A_log", "D", "out_proj"):
        t = getattr(q, name)
        assert t.codes.dtype == torch.int8 and t.codes.shape == getattr(fp16, name).shape, name
    no_bias = int8_layer(type(fp16)(**{**fp16.__dict__, "conv_bias": None}))
    assert no_bias.conv_bias is None


def test_embedding_cache_follows_the_ids(bank):
    ids = torch.tensor([[1, 2, 3]])
    a = bank.embed(ids, True, torch.float16)
    assert bank.embed(ids.clone(), True, torch.float16) is a           # same ids: kept
    b = bank.embed(torch.tensor([[1, 2, 4]]), True, torch.float16)     # other ids: recomputed
    assert torch.equal(b[0, :2], a[0, :2]) and not torch.equal(b[0, 2], a[0, 2])
    assert not torch.equal(bank.embed(ids, False, torch.float16), a)   # rotation is part of the key
    assert bank.embed(ids, True, torch.float32).dtype == torch.float32


def test_observer_state_records():
    mm = MinMaxObserver()
    assert mm.state()["samples"] == 0 and mm.state()["amax"] != mm.state()["amax"]   # nan before data
    mm.observe(torch.tensor([[1.0, -3.0], [2.0, 0.5]]))
    mm.observe(torch.tensor([[0.25, 2.5]]))
    assert mm.state() == {"amax": 3.0, "samples": 3}
    p = PercentileObserver(0.5)
    p.observe(torch.tensor([[1.0, 3.0], [2.0, 4.0]]))
    st = p.state()
    # quantile(|a|, 0.5) per sample: 2.0 then 3.0; EMA 2.0 + 0.01 * (3.0 - 2.0)
    assert st["alpha"] == 0.5 and st["samples"] == 2 and st["raw_max"] == 4.0
    assert st["ema_quantile"] == pytest.approx(2.01, abs=1e-6)
    assert PercentileObserver(1.0).state()["samples"] == 0


def test_read_documents_formats_and_errors(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n\n  \n{"text": "two"}\n"three"\n')
    assert read_documents(tmp_path / "a.jsonl") == ["one", "two", "three"]
    (tmp_path / "b.txt").write_text("plain text\n{not json}\n")
    assert read_documents(tmp_path / "b.txt") == ["plain text\n{not json}\n"]
    (tmp_path / "c.txt").write_text("  \n")
    assert read_documents(tmp_path / "c.txt") == []
    (tmp_path / "e.txt").write_bytes(b"")
    assert read_documents(tmp_path / "e.txt") == []
    (tmp_path / "d.JSON").write_text('{"text": "x"}\n{"txt": "y"}\n')
    with pytest.raises(DataError, match=r"d.JSON:2: a JSON dict without a 'text' field"):
        read_documents(tmp_path / "d.JSON")
    with pytest.raises(DataError, match="cannot read text file"):
        read_documents(tmp_path / "missing.jsonl")


def test_sample_records_where_it_came_from(tmp_path):
    from conftest import SHIPPED
    from harness.checkpoints.tokenizer import load_tokenizer
    tok = load_tokenizer(SHIPPED)
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"text": " ".join(["the"] * 10)}) + "\n")
    got = read_sample(tok, path, 4)
    assert got.sha256 == hashlib.sha256(path.read_bytes()).hexdigest() and got.path == path
    assert (got.n_documents, got.documents_used) == (1, 1)
    with pytest.raises(DataError, match="--seq_len must be a positive number of tokens, got 0"):
        read_sample(tok, path, 0)


def test_int8_weights_are_quantized_from_the_same_rotation(bank):
    """The rotated int8 layer comes from the rotated fp16 layer (not the unrotated one)."""
    for rotate in (True, False):
        q, ref = bank.layer(0, "int8", rotate), int8_layer(bank.layer(0, "fp16", rotate))
        assert torch.equal(q.in_proj.codes, ref.in_proj.codes) and q.in_proj.scale == ref.in_proj.scale
        assert torch.equal(q.out_proj.codes, ref.out_proj.codes)
    assert not torch.equal(bank.layer(0, "int8", True).in_proj.codes, bank.layer(0, "int8", False).in_proj.codes)


def test_minmax_observer_rounds_to_fp16_first():
    """A value off the fp16 grid is observed as its fp16 rounding (the recorded amax is an fp16 number)."""
    mm = MinMaxObserver()
    mm.observe(torch.tensor([[0.1, -0.05]]))
    assert mm.state()["amax"] == float(torch.tensor(0.1).half())


def test_an_untied_lm_head_is_prepared_from_its_own_weight(tmp_path):
    """Quamba folds norm_f into the model's lm_head, the embedding only where they are tied, each operand and the
    product rounded to fp16 (mutants that took the embedding, dropped one rounding or divided by the norm
    survived: the other tests' norm_f is all ones)."""
    from conftest import make_hf_model, write_hf_dir
    from harness.architectures.mamba1.weights import fht_fp16
    from harness.runner.weightbank import lm_head_weight
    model = make_hf_model(vocab=4096, n_layer=1, seed=3)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight) * 0.05)
    with torch.no_grad():  # off the fp16 grid and away from 1, so that every fp16 rounding and the fold show
        model.backbone.norm_f.weight.uniform_(0.5, 1.5)
    got = lm_head_weight(open_checkpoint(write_hf_dir(tmp_path / "untied", model)))
    norm = model.backbone.norm_f.weight.detach().to(torch.float16).double()
    folded = (model.lm_head.weight.detach().to(torch.float16).double() * norm).to(torch.float16)
    assert torch.equal(got, fht_fp16(folded))
    tied = lm_head_weight(open_checkpoint(write_hf_dir(tmp_path / "tied", make_hf_model(vocab=4096, n_layer=1, seed=3))))
    assert not torch.equal(got, tied)


def test_release_forgets_one_block_and_keeps_the_others(own):
    """release(i) drops block i's raw and prepared tensors and nothing else, and accepts a block never loaded
    (mutants that released the wrong block, none, or raised on a missing one survived: values are recomputed
    the same either way, only memory grows, which issue 9's flat-memory walk over every layer relies on)."""
    a0, a1 = own.layer(0, "int8", True), own.layer(1, "int8", True)
    own.release(0)
    assert 0 not in own._raw and not [k for k in own._layers if k[0] == 0]
    assert own.layer(1, "int8", True) is a1 and 1 in own._raw
    assert own.layer(0, "int8", True) is not a0
    own.release(5)  # never loaded


def test_quamba_int8_layer_honours_rotate(bank):
    """prep=quamba without the rotation is the fp16 checkpoint quantized as it is (a mutant that always rotated
    survived: the built-in modes rotate, only a user mode with rotate=no reaches this)."""
    from harness.architectures.mamba1.weights import float_layer, quamba_int8_layer
    raw = bank.raw(0)
    plain, rotated = quamba_int8_layer(raw, False), quamba_int8_layer(raw, True)
    assert torch.equal(plain.in_proj.codes, int8_layer(float_layer(raw, False, torch.float16)).in_proj.codes)
    assert not torch.equal(plain.in_proj.codes, rotated.in_proj.codes)
    # through the bank too (a mutant that always rotated prep=quamba's fp16 weights there survived)
    assert torch.equal(bank.layer(0, "fp16", False, "quamba").in_proj, float_layer(raw, False, torch.float16).in_proj)


def test_fht_fp16_rounds_its_input_to_fp16_first():
    """The fp16 tensor is what the kernel reads: inputs off the fp16 grid (the float embedding's fp32 rows) are
    rounded before the transform (a mutant that skipped it survived: the other callers round already)."""
    from harness.kernels.hadamard import hadamard_transform_fht
    from harness.kernels.quant import round_to_dtype
    from harness.architectures.mamba1.weights import fht_fp16
    w = torch.randn(64, 48, generator=torch.Generator().manual_seed(6))
    f16 = lambda t: round_to_dtype(t, torch.float16)  # noqa: E731
    assert torch.equal(fht_fp16(w), f16(hadamard_transform_fht(f16(w))))
    assert not torch.equal(fht_fp16(w), f16(hadamard_transform_fht(w)))


def test_an_empty_document_list_tokenizes_to_an_empty_int64_stream(tmp_path):
    """torch.tensor([]) is float32: the ids' dtype is stated, not inferred (a mutant without it survived: any
    non-empty stream infers int64)."""
    from harness.checkpoints.text import tokenize_file
    from harness.checkpoints.tokenizer import load_tokenizer
    from conftest import SHIPPED
    (tmp_path / "empty.jsonl").write_text("\n")
    ids = tokenize_file(load_tokenizer(SHIPPED), tmp_path / "empty.jsonl")
    assert ids.dtype == torch.int64 and ids.shape == (0,)


def test_quamba_preparation_without_rotation_and_without_a_conv_bias(bank):
    """prep=quamba unrotated is the checkpoint rounded to fp16, every field (mutants that rotated it anyway or
    skipped the fp16 rounding survived); a checkpoint without a conv bias (mamba_ssm's conv_bias=False, which
    loading accepts) prepares without one, rotated or not (a mutant that rounded the missing bias survived)."""
    import dataclasses
    from harness.architectures.mamba1.weights import float_layer, quamba_fp16_layer, quamba_int8_layer
    raw = dict(bank.raw(0))
    plain, ref = quamba_fp16_layer(raw, False), float_layer(raw, False, torch.float16)
    for f in dataclasses.fields(plain):
        a, b = getattr(plain, f.name), getattr(ref, f.name)
        assert (a is None and b is None) or torch.equal(a, b), f.name
    assert not torch.equal(plain.in_proj, raw["in_proj"])  # the fp16 rounding moved something
    no_bias = {**raw, "conv_bias": None}
    for rotate in (True, False):
        assert quamba_fp16_layer(no_bias, rotate).conv_bias is None and quamba_int8_layer(no_bias, rotate).conv_bias is None


def test_keep_only_keeps_what_the_coming_modes_need_and_nothing_else(own):
    """After keep_only, a prepared variant outside the wanted set (int8's fp16 source) and the raw tensors are
    not kept (a mutant that forgot the wanted set survived: the values are the same, memory is not)."""
    own.keep_only({("int8", True, "quamba")})
    q = own.layer(0, "int8", True, "quamba")
    assert own.layer(0, "int8", True, "quamba") is q
    assert list(own._layers) == [(0, "int8", True, "quamba")] and own._raw == {}


def test_keep_only_drops_the_unwanted_variants_already_prepared(own, monkeypatch):
    """Variants prepared before keep_only: the wanted one stays (the same object), the others go, and the
    checkpoint's pages are dropped (mutants that compared the wrong part of the key, kept the unwanted ones or
    skipped drop_pages survived: the values are the same, memory is not)."""
    dropped = []
    monkeypatch.setattr(own.ckpt, "drop_pages", lambda: dropped.append(True))
    q, f = own.layer(0, "int8", True, "quamba"), own.layer(0, "fp32", False)
    own.keep_only({("int8", True, "quamba")})
    assert own.layer(0, "int8", True, "quamba") is q and list(own._layers) == [(0, "int8", True, "quamba")]
    assert dropped and own.layer(0, "fp32", False) is not f


def test_a_quantized_checkpoint_alone_names_the_missing_float_model(tmp_path):
    """Float weights from a bank that holds only a Quamba checkpoint: FloatModelRequired names what needed them
    and the option (mutants that raised it with None, or named None, survived: the CLI tests that read the
    message run in a subprocess)."""
    from quamba_fixture import write_handmade
    from harness.recipes.quamba.checkpoint import open_quamba
    from harness.runner.weightbank import FloatModelRequired
    given = WeightBank(None, given=open_quamba(write_handmade(tmp_path / "q")))
    with pytest.raises(FloatModelRequired, match=r"^float weights needs the float model; pass --mamba_model_path DIR "
                                                 r"\(the quantized checkpoint only holds rotated int8 weights\)$"):
        given.raw(0)
    with pytest.raises(FloatModelRequired, match=r"^the float embedding needs the float model; "):
        given.embed(torch.zeros(1, 4, dtype=torch.int64), False, torch.float32)


def test_an_unknown_prep_is_refused_with_the_valid_ones(bank):
    """The message names the prep and the valid ones (mutants that raised ValueError(None) or joined None
    survived)."""
    with pytest.raises(ValueError, match=r"^unknown prep 'bogus'; valid: quamba, exact$"):
        bank.layer(0, "fp32", False, "bogus")
