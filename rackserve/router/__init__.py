"""The cluster face: picks instances for requests and orchestrates prefill/decode."""
