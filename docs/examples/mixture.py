import zephon
from zephon.ops import batch, ensure_mixture, fetch, pack_sequences, tokenize
from zephon.sources import ListSource, MixtureSource

# Two corpora with different document lengths: web pages are much longer than code snippets.
web = ListSource([{"text": "w" * (50 + i % 400)} for i in range(20_000)], dataset_id=0)
code = ListSource([{"text": "c" * (20 + i % 60)} for i in range(20_000)], dataset_id=1)
weights = {"web": 0.7, "code": 0.3}
source = MixtureSource({"web": web, "code": code}, weights, seed=0)

pipeline = zephon.Pipeline(
    source,
    [
        fetch(),
        tokenize(max_len=512, split_long_samples=True),
        ensure_mixture(weights, by="tokens"),  # balance tokens, before packing mixes them
        pack_sequences(1024),
        batch(8),
    ],
)
with iter(pipeline) as loader:
    for b in loader:
        pass  # train on b.payload
    stats = loader.stats()
print(stats["mixture"], stats["mixture_dropped"])
