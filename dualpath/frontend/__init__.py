"""The OpenAI-compatible HTTP front end in front of the scheduler (`dualpath frontend`;
server.py, docs/vllm.md)."""
