# -DEPLB_SANITIZE=address,undefined  or  -DEPLB_SANITIZE=thread
if(EPLB_SANITIZE)
  if(EPLB_SANITIZE MATCHES "thread" AND EPLB_SANITIZE MATCHES "address")
    message(FATAL_ERROR "EPLB_SANITIZE=${EPLB_SANITIZE}: thread cannot be combined with address; "
                        "use address,undefined or thread")
  endif()
  set(_eplb_san_flags -fsanitize=${EPLB_SANITIZE} -fno-omit-frame-pointer -g)
  if(EPLB_SANITIZE MATCHES "undefined")
    list(APPEND _eplb_san_flags -fno-sanitize-recover=undefined)
  endif()
  # Host compilers only: nvcc does not take these flags (CUDA code is not sanitized).
  add_compile_options("$<$<COMPILE_LANGUAGE:C,CXX>:${_eplb_san_flags}>")
  add_link_options(-fsanitize=${EPLB_SANITIZE})
  message(STATUS "eplb: building with -fsanitize=${EPLB_SANITIZE}")
endif()
