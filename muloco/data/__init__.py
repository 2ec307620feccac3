"""Training data: sources (builtin corpus, token memmaps, text files) and per-replica streams.

- `builtin.py`: the offline corpus, this interpreter's stdlib `.py` files as bytes, built once into a cache
  (`<cache_dir>/builtin-py3.11-v1-val0.05/{train.bin,val.bin,meta.json}`) atomically.
- `sources.py`: `load_data(cfg.data, seq_len) -> TokenData` for `data.source` builtin | tokens | text, with
  one-line `DataError`s naming the field or file and the fix.
- `stream.py`: `ReplicaStream`, replica r of K's deterministic, disjoint, resumable batches, and
  `val_batches`, the fixed validation set.

docs/data.md describes the design.
"""

from muloco.data.builtin import ensure_builtin_corpus
from muloco.data.sources import TokenData, load_data
from muloco.data.stream import ReplicaStream, val_batches

__all__ = ["ReplicaStream", "TokenData", "ensure_builtin_corpus", "load_data", "val_batches"]
