"""What runs at load and launch time: the wrapper's loading (``load``), generated kernels' modules and
their cache (``kernels``), launches (``launch``), precompile workers (``precompile``), target checks
(``check``) and CUDA graphs (``cudagraph``). Generated kernel modules import ``kiln.runtime.launch``."""
