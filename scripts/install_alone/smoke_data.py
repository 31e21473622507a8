"""install_alone smoke for automodel-data (torch + numpy only; megatron-core added after the checks, for
the README's corpus): the README's whole resume example as written (a megatron-core corpus read by a
2-rank torchrun loop that stops, resumes on 1 rank, then on 4; its last command compares the global
sequence with an uninterrupted run's), and a missing extra named by its error.

Usage: python smoke_data.py README.md   (run in an empty directory; writes the example's files there)
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from automodel.data import MissingExtraError
from automodel.data.errors import optional

if __name__ == "__main__":
    text = Path(sys.argv[1]).read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    Path("write_corpus.py").write_text(next(b for b in blocks if "IndexedDatasetBuilder" in b))
    Path("loop.py").write_text(next(b for b in blocks if "build_loader(" in b and "init_process_group" in b))
    bash = next(b for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S) if "loop.py" in b)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    last = ""
    for line in (x for x in bash.splitlines() if x.strip()):
        proc = subprocess.run(["bash", "-c", line], env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            sys.exit(f"README command failed: {line}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        last = proc.stdout.strip()
    assert last == "same global sequence", last
    steps = [json.loads(x) for x in Path("run/samples.jsonl").read_text().splitlines()]
    assert len(steps) == 9 and all(len(s) == 8 for s in steps), [len(s) for s in steps]
    try:
        optional("transformers", needed_for="a Hugging Face tokenizer")
        sys.exit("transformers is importable, though automodel-data does not require it")
    except MissingExtraError as e:
        assert "automodel-data[hf]" in str(e), e
    print("smoke_data: README example resumed on 1 and 4 ranks, same global sequence as 2 uninterrupted")
