"""The vLLM engine, node side: a vLLM instance beside the node, whose connector
(dualpath/vllm/, inside vLLM's processes) attaches its workers here.

- :mod:`.engine`         the KvConnector steps the workers call, by vLLM's names:
                          get_num_new_matched_tokens, start_load_kv, begin/end_save
- :mod:`.kind`           how a node opens it (dualpath/engines/protocol.py)
- :mod:`.prefill`        a P/D prefill: stage the hit, drive the instance, send its saves
- :mod:`.decode`         a P/D decode: the instance's decode from the DE buffer
- :mod:`.stage`          a staged hit as vLLM's load finds it, layer by layer
- :mod:`.instance`       the instance's OpenAI HTTP API
- :mod:`.instance_cache` what the instance's own prefix cache likely holds (a hint)
"""
