"""The cluster face: picks an instance (and DP rank) for each request from what the instances'
KV events say they cache and what the router itself has sent them, and orchestrates
prefill/decode (disagg.py; pd_proxy.py is the plain two-hop proxy)."""

# What an instance is for: whole requests (a plain --worker), or one side of the P/D flow. Here,
# not in router.py, so that commands that only start instances (cluster) import nothing heavy.
BOTH, PREFILL, DECODE = "both", "prefill", "decode"
