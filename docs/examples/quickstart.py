import zephon
from zephon.ops import batch, fetch, filter_records, pack_sequences, tokenize
from zephon.sources import ListSource

texts = [{"text": f"document {i} " + "lorem ipsum " * (i % 40)} for i in range(5_000)]
pipeline = zephon.Pipeline(
    ListSource(texts, chunk_size=256, shuffle=True, seed=0),
    [
        fetch(),
        filter_records(lambda p: len(p["text"]) > 20),   # drops leave tombstones automatically
        tokenize(max_len=256, split_long_samples=True),  # bytes -> int32 ids, long texts split
        pack_sequences(512),                             # best-fit packing into 512-token rows
        batch(8),
    ],
    lanes=2,
)
loader = iter(pipeline)
for step, b in zip(range(50), loader):
    tokens = b.payload["tokens"]          # numpy int32 array of shape (8, 512)
state = loader.state_dict()               # small JSON dict: save it next to the model
zephon.save_checkpoint("loader.json", state)

resumed = pipeline.iter(state=zephon.load_checkpoint("loader.json"))
next_batch = next(resumed)                # exactly the batch step 50 would have produced
