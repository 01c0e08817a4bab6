"""docs/checkpoints.md's reader (numpy only), loaded from the document itself: the lines a user copies are the lines
the tests run. `read_safetensors(path)` gives (tensors by name, metadata); `read_sharded(ckpt)` a sharded checkpoint,
whole."""
import os
import re

_doc = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs", "checkpoints.md")).read()
_ns = {}
exec(re.search(r"```python\n(.*?)```", _doc, re.S).group(1), _ns)
read_safetensors, read_sharded = _ns["read_safetensors"], _ns["read_sharded"]
