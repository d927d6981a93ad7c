"""The cluster face: picks an instance (and DP rank) for each request from what the instances'
KV events say they cache and what the router itself has sent them, and orchestrates
prefill/decode (pd_proxy.py)."""
