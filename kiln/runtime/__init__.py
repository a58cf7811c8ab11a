"""What runs at load and launch time: loading wrappers (``load``) and kernel modules (``kernels``),
launches (``launch``), precompile workers, C++ builds (``cpp_build``) and CUDA graphs (``cudagraph``)."""
