"""The C++ emitter: kernel plans as one C++/OpenMP translation unit per graph (``module.write_unit``)."""
