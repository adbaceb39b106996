"""Corpora (built-in offline, online ``datasets`` loaders, user folders) and per-user splits."""
from .corpora import BUILTIN, ONLINE, builtin, calibration_docs, user_dirs
from .sources import load_corpus
from .splits import (SplitConfig, UserData, check_seq_len, describe_partition, make_user_data, sample_batch, token_table,
                     tokenize_docs)

__all__ = ["BUILTIN", "ONLINE", "builtin", "calibration_docs", "load_corpus", "user_dirs", "SplitConfig", "UserData",
           "check_seq_len", "describe_partition", "make_user_data", "sample_batch", "token_table", "tokenize_docs"]
