"""Training and evaluation text: corpora and the run's tokenizer.

- :mod:`peerd.data.corpus`: loading a corpus (the bundled Shakespeare, local files, .jsonl, .parquet), its
  train/held-out split, the window sampler and the byte tokenizer.
- :mod:`peerd.data.corpus_store`: a machine's cache of large corpora, memory-mapped and tokenized once.
- :mod:`peerd.data.tokenizer`: the run's byte-level BPE (training, the tokenizer cache, ``bpe:<sha256>`` specs).
"""
