"""MixtureSource(by="tokens"): sample shares from per-component token costs estimated once, at
construction, deterministically (length column, bytes x pinned or calibrated tokens per byte)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from zephon.errors import PlanError
from zephon.ops import ByteTokenizer, image_token_counter
from zephon.sources import ArrowSource, ListSource, MixtureSource
from zephon.sources.token_costs import QUANTUM, estimate_indices

REPO = Path(__file__).resolve().parents[2]


def texts(dataset: int, n: int, base: int, spread: int) -> ListSource:
    return ListSource(
        [{"text": "é" * (base + (i * 7919) % spread), "n": base + i % 3} for i in range(n)],
        dataset_id=dataset,
    )


def long_and_short(**kw) -> MixtureSource:
    parts = {"long": texts(0, 3000, 400, 200), "short": texts(1, 5000, 20, 10)}
    return MixtureSource(parts, {"long": 0.7, "short": 0.3}, chunk_size=128, **kw)


def test_sample_shares_are_weights_over_token_costs_so_token_shares_are_the_weights() -> None:
    mix = long_and_short(by="tokens", tokenizer=ByteTokenizer())
    costs = {n: c.tokens_per_sample for n, c in mix.token_costs().items()}
    raw = {"long": Fraction(0.7) / costs["long"], "short": Fraction(0.3) / costs["short"]}
    for name, share in mix.sample_shares().items():
        assert share == float(raw[name] / sum(raw.values()))
    expected = {n: mix.sample_shares()[n] * float(costs[n]) for n in costs}
    total = sum(expected.values())
    assert expected["long"] / total == pytest.approx(0.7, abs=1e-9)
    # the long component is drawn ~14x less often per sample than by samples
    assert mix.sample_shares()["long"] < 0.15
    assert mix.target_mixture() == ("tokens", {"long": 0.7, "short": 0.3})


def test_byte_tokenizer_calibrates_two_bytes_per_char_and_adds_the_eos() -> None:
    mix = long_and_short(by="tokens", tokenizer=ByteTokenizer(), estimate_size=10_000)
    short = mix.token_costs()["short"]
    assert short.tokens_per_byte == 1
    assert short.calibrated == 256 and short.sampled == 5000  # measured whole
    items = texts(1, 5000, 20, 10).items
    mean_bytes = Fraction(sum(len(x["text"].encode()) for x in items), len(items))
    assert short.mean_bytes == mean_bytes
    assert short.tokens_per_sample == round((mean_bytes + 1) / QUANTUM) * QUANTUM


def test_a_pinned_ratio_a_dict_of_ratios_and_a_length_column() -> None:
    pinned = long_and_short(by="tokens", tokens_per_byte=0.5, added_tokens=0)
    for cost in pinned.token_costs().values():
        assert cost.tokens_per_byte == Fraction(1, 2) and cost.calibrated == 0
        assert cost.mean_bytes is not None
        assert cost.tokens_per_sample == round(cost.mean_bytes / 2 / QUANTUM) * QUANTUM
    mixed = long_and_short(by="tokens", tokens_per_byte={"long": 0.25}, tokenizer=ByteTokenizer())
    assert mixed.token_costs()["long"].tokens_per_byte == Fraction(1, 4)
    assert mixed.token_costs()["short"].tokens_per_byte == 1  # calibrated
    column = long_and_short(by="tokens", length_column="n", estimate_size=10_000)
    short = column.token_costs()["short"]
    assert short.method == "length_column"
    assert short.tokens_per_sample == Fraction(sum(20 + i % 3 for i in range(5000)), 5000) + 1


def test_the_estimate_sample_is_fixed_by_the_component_name_not_the_seed() -> None:
    a = long_and_short(by="tokens", tokenizer=ByteTokenizer(), seed=1)
    b = long_and_short(by="tokens", tokenizer=ByteTokenizer(), seed=2)
    assert a.describe()["token_costs"] == b.describe()["token_costs"]
    idx = estimate_indices("long", 3000, 1024)
    assert len(set(idx.tolist())) == 1024 and idx.min() >= 0 and idx.max() < 3000
    assert estimate_indices("long", 3000, 1024).tolist() == idx.tolist()
    assert estimate_indices("short", 3000, 1024).tolist() != idx.tolist()


def test_the_estimate_is_part_of_the_fingerprint() -> None:
    base = long_and_short(by="tokens", tokens_per_byte=0.5).describe()
    assert base["by"] == "tokens" and base["token_costs"] and base["sample_shares"]
    assert base == long_and_short(by="tokens", tokens_per_byte=0.5).describe()
    assert base != long_and_short(by="tokens", tokens_per_byte=0.4).describe()
    assert base != long_and_short(by="tokens", tokens_per_byte=0.5, added_tokens=0).describe()
    assert long_and_short().describe()["by"] == "samples"


def pictures(**kw) -> MixtureSource:
    """A text component and one whose samples each hold ``i % 3`` images of 32 x 48 pixels."""
    docs = ListSource(
        [{"text": "ab", "image_sizes": [[32, 48]] * (i % 3)} for i in range(300)], dataset_id=1
    )
    parts = {"text": texts(0, 300, 10, 5), "pics": docs}
    return MixtureSource(parts, {"text": 0.5, "pics": 0.5}, by="tokens", tokens_per_byte=0.5, **kw)


def test_image_tokens_add_the_mean_image_tokens_of_the_estimate_sample() -> None:
    counter = image_token_counter(patch_size=4, merge=2, image_start_id=1, image_end_id=2)
    mix = pictures(image_tokens=counter)
    pics = mix.token_costs()["pics"]
    per_image = (32 // 8) * (48 // 8) + 2  # the grid cells, and the start and end ids
    mean = Fraction(sum(i % 3 for i in range(300)) * per_image, 300)
    assert pics.mean_image_tokens == mean
    assert pics.tokens_per_sample == Fraction(2, 2) + 1 + mean  # text, eos, images
    assert mix.token_costs()["text"].mean_image_tokens == 0  # no sizes: no images
    assert pics.describe()["mean_image_tokens"] == float(mean)
    # by its text alone the picture component would cost 2 tokens a sample
    assert pictures().token_costs()["pics"].tokens_per_sample == 2
    assert mix.sample_shares()["pics"] < 0.5 < pictures().sample_shares()["pics"]


def test_the_image_token_scheme_is_part_of_the_fingerprint() -> None:
    a = pictures(image_tokens=image_token_counter(patch_size=4, merge=2)).describe()
    assert a == pictures(image_tokens=image_token_counter(patch_size=4, merge=2)).describe()
    assert a != pictures(image_tokens=image_token_counter(patch_size=4, merge=1)).describe()
    assert a["estimate"]["image_tokens"]["describe"]["patch_size"] == 4
    # without it, the estimate's identity is what it was before image tokens were counted
    assert "image_tokens" not in pictures().describe()["estimate"]
    assert "mean_image_tokens" not in pictures().describe()["token_costs"]["pics"]


def test_image_token_mistakes_are_named() -> None:
    with pytest.raises(ValueError, match="image_tokens only apply with by='tokens'"):
        long_and_short(image_tokens=image_token_counter(patch_size=4))
    with pytest.raises(TypeError, match="image_tokens must be a function of a raw record"):
        pictures(image_tokens=3)
    with pytest.raises(PlanError, match=r"image_tokens gave -1 for sample \d+ of component"):
        pictures(image_tokens=lambda payload: -1)
    with pytest.raises(PlanError, match=r"image_tokens failed on sample \d+ of component"):
        pictures(image_tokens=lambda payload: payload["missing"])


def test_weight_zero_components_are_not_estimated() -> None:
    parts = {"a": texts(0, 50, 10, 5), "b": ListSource([{"other": 1}] * 10, dataset_id=1)}
    mix = MixtureSource(parts, {"a": 1.0, "b": 0.0}, by="tokens", tokens_per_byte=1.0)
    assert set(mix.token_costs()) == {"a"}
    assert mix.sample_shares() == {"a": 1.0, "b": 0.0}


def test_mistakes_are_named() -> None:
    with pytest.raises(ValueError, match="component 'long' needs a token cost"):
        long_and_short(by="tokens")
    with pytest.raises(ValueError, match="tokenizer only apply with by='tokens'"):
        long_and_short(tokenizer=ByteTokenizer())
    with pytest.raises(ValueError, match="by must be one of"):
        long_and_short(by="bytes")
    with pytest.raises(ValueError, match="names 'other', which is no component"):
        long_and_short(by="tokens", tokens_per_byte={"other": 1.0})
    with pytest.raises(ValueError, match="tokens_per_byte of 'long' must be finite and > 0"):
        long_and_short(by="tokens", tokens_per_byte=0)
    with pytest.raises(TypeError, match="must be a number"):
        long_and_short(by="tokens", tokens_per_byte="0.3")
    with pytest.raises(ValueError, match=r"sample \d+ of component 'long' has no field 'body'"):
        long_and_short(by="tokens", tokens_per_byte=1.0, text_field="body")
    with pytest.raises(TypeError, match=r"length_column 'text' of sample .* not an int"):
        long_and_short(by="tokens", length_column="text")
    empty = {"a": ListSource([], dataset_id=0), "b": texts(1, 10, 5, 2)}
    with pytest.raises(ValueError, match="component 'a' has no samples"):
        MixtureSource(empty, {"a": 1.0, "b": 1.0}, by="tokens", tokens_per_byte=1.0)
    blank = {"a": ListSource([{"text": ""}] * 5, dataset_id=0), "b": texts(1, 10, 5, 2)}
    with pytest.raises(ValueError, match="component 'a' costs 0 tokens"):
        MixtureSource(blank, {"a": 1.0, "b": 1.0}, by="tokens", tokens_per_byte=1.0, added_tokens=0)


def words_only() -> Tokenizer:
    """A real tokenizer that fails on a word it does not know (it has no unknown token)."""
    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1}))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


def test_a_tokenizer_failing_in_calibration_is_named_with_the_component_sample_and_file(
    tmp_path: Path,
) -> None:
    rows = ["a b", "b a a", "a", "a zzz b", "b"]
    pq.write_table(pa.table({"text": rows}), tmp_path / "bad.parquet")
    parts = {
        "good": ListSource([{"text": "a b"}] * 5, dataset_id=0),
        "bad": ArrowSource([tmp_path / "bad.parquet"], dataset_id=1),
    }
    with pytest.raises(PlanError) as caught:
        MixtureSource(parts, {"good": 0.5, "bad": 0.5}, by="tokens", tokenizer=words_only())
    message = str(caught.value)
    assert "component 'bad'" in message and "sample 3" in message
    assert "bad.parquet" in message and "Missing [UNK] token" in message
    assert "tokens_per_byte=" in message  # what to do
    assert "Missing [UNK] token" in str(caught.value.__cause__)


def test_a_tokenizer_failing_on_a_whole_batch_only_is_named_with_the_component() -> None:
    class OneAtATime:
        """Encodes one text per call and refuses batches of more."""

        def encode(self, text: str) -> list[int]:
            return list(range(len(text.split())))

        def encode_batch(self, texts: list[str]) -> list[list[int]]:
            if len(texts) > 1:
                raise RuntimeError("batches are not supported")
            return [self.encode(t) for t in texts]

    with pytest.raises(PlanError, match=r"component 'long'.*its 256 calibration samples") as e:
        long_and_short(by="tokens", tokenizer=OneAtATime())
    assert isinstance(e.value.__cause__, RuntimeError)


_ESTIMATE = """
import json, sys
from tokenizers import Tokenizer
from zephon.sources import ArrowSource, MixtureSource
bpe = Tokenizer.from_file(sys.argv[1])
parts = {n: ArrowSource([f"{sys.argv[2]}/{n}.parquet"], dataset_id=i)
         for i, n in enumerate(["code", "prose"])}
mix = MixtureSource(parts, {"code": 0.7, "prose": 0.3}, by="tokens", tokenizer=bpe)
print(json.dumps(mix.describe()["token_costs"], sort_keys=True))
"""


def test_a_calibrated_estimate_is_identical_across_processes_and_thread_counts(
    tmp_path: Path,
) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    words = {"code": ["def", "return", "self", "x", "=", "()"], "prose": ["the", "river", "ran"]}
    for name, vocab in words.items():
        docs = [
            " ".join(vocab[(j * k) % len(vocab)] for k in range(5 + j % 90)) for j in range(3000)
        ]
        pq.write_table(pa.table({"text": docs}), tmp_path / f"{name}.parquet", row_group_size=256)
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    corpus = [" ".join(v) for v in words.values()] * 20
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>"]))
    bpe.save(str(tmp_path / "bpe.json"))
    results = set()
    for threads in ("1", "2"):
        env = {**os.environ, "RAYON_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "true"}
        env["PYTHONPATH"] = str(REPO)
        done = subprocess.run(
            [sys.executable, "-c", _ESTIMATE, str(tmp_path / "bpe.json"), str(tmp_path)],
            capture_output=True,
            text=True,
            env=env,
            check=True,
            cwd=REPO,
        )
        results.add(done.stdout)
    assert len(results) == 1
    here = MixtureSource(
        {n: ArrowSource([tmp_path / f"{n}.parquet"], dataset_id=i) for i, n in enumerate(words)},
        {"code": 0.7, "prose": 0.3},
        by="tokens",
        tokenizer=Tokenizer.from_file(str(tmp_path / "bpe.json")),
    )
    assert json.loads(results.pop()) == json.loads(
        json.dumps(here.describe()["token_costs"], sort_keys=True)
    )


def test_a_tokenizer_with_padding_enabled_is_calibrated_on_its_real_tokens() -> None:
    # tokenize refuses such a tokenizer (no_padding() first); the source, built before that,
    # must not count the padding each calibration batch gets up to its longest text.
    bpe = Tokenizer(models.WordLevel({"<pad>": 0, "é": 1}, unk_token="<pad>"))
    bpe.pre_tokenizer = pre_tokenizers.Split("é", "isolated")
    plain = long_and_short(by="tokens", tokenizer=bpe).token_costs()
    bpe.enable_padding(pad_id=0, pad_token="<pad>")
    padded = long_and_short(by="tokens", tokenizer=bpe).token_costs()
    assert padded == plain
    assert plain["short"].tokens_per_byte == Fraction(1, 2)  # one token per two-byte "é"


def test_a_tokenizer_with_truncation_enabled_is_refused_naming_the_component() -> None:
    # Its calibration would count each text cut at max_length, a cost tokenize never makes
    # (tokenize refuses such a tokenizer until no_truncation()).
    tok = Tokenizer(models.WordLevel({"<pad>": 0, "é": 1}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("é", "isolated")
    tok.enable_truncation(max_length=16)
    with pytest.raises(PlanError, match=r"component 'long'.*truncation.*no_truncation\(\)"):
        long_and_short(by="tokens", tokenizer=tok)
    tok.no_truncation()
    assert long_and_short(by="tokens", tokenizer=tok).token_costs()["long"].tokens_per_byte == 0.5
