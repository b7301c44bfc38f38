# Warnings on and clean for every eplb target: eplb_warnings is linked PRIVATE by each target.
add_library(eplb_warnings INTERFACE)
target_compile_options(eplb_warnings INTERFACE
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor -Wcast-align
  -Woverloaded-virtual -Wimplicit-fallthrough>)
