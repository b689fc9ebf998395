// Boost.JSON compiled into the fuzz targets (header-only mode) rather than linked from the distro
// library: the parser itself is then instrumented, so coverage feedback reaches into it, and the
// gcc-built library never meets clang's sanitizer runtime.
#include <boost/json/src.hpp>
