"""Output-length predictors for TD-Pipe's Algorithm 1 (§3.3): base.py has the interface and the simple ones
(oracle, constant, auto), factory.py turns a `--predictor` spec into one; the rest is the learned predictor
(after μ-Serve) and the request history it learns from.

encoder.py: all-MiniLM-L6-v2 (a 6-layer BERT) as a frozen sentence encoder; history.py: the JSONL history
tdpipe records (`--record-history`) and a ShareGPT loader; model.py: length buckets + a two-layer head;
train.py: the 60/20/20 split, training and the paper's Figure 14 evaluation; cli.py: `tdpipe predictor`.
"""
