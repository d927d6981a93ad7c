"""The cluster face: picks an instance (and DP rank) for each request from what the instances'
KV events say they cache and what the router itself has sent them, and orchestrates
prefill/decode (disagg.py; pd_proxy.py is the plain two-hop proxy)."""

# What an instance is for: whole requests (a plain --worker), or one side of the P/D flow. Here,
# not in router.py, so that commands that only start instances (cluster) import nothing heavy.
BOTH, PREFILL, DECODE = "both", "prefill", "decode"
# A whole answer the router reads from an instance (--max-answer-bytes): one answering without end
# (broken, or not a rackserve one) must cost one client a 502, not the router its memory.
MAX_ANSWER_BYTES = 1 << 29
