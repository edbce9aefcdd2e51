"""What the bench scripts share, one copy each: where things are (`paths`), starting and stopping
servers (`server`: ours and the peers, one launcher), llama.cpp's own server built for comparison
and the bundled model (`peers`), fleet files (`fleet`), streamed chat load (`load`), statistics
(`stats`) and notes on the machine and the code measured (`machine`).

Scripts import it as `bench.kit.<module>` and run as modules from the repository root
(`.venv/bin/python -m bench.throughput`), so no script edits the import path.
"""
