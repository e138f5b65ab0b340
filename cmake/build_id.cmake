# Writes OUT (a header defining IDEM_BUILD) with `git describe` of SRC: the
# commit a binary was built from, so `idemproxy --version` tells two builds
# of one release apart (a rolling upgrade's old and new processes). Empty
# outside a git checkout. Run at every build; the file is rewritten only
# when its text changes, so an unchanged commit recompiles nothing.
execute_process(COMMAND git -C "${SRC}" describe --always --dirty --abbrev=12
                OUTPUT_VARIABLE described RESULT_VARIABLE rc
                OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
if(rc EQUAL 0 AND described MATCHES "^[0-9A-Za-z._+-]+$")
  set(text "#define IDEM_BUILD \"${described}\"\n")
else()
  set(text "#define IDEM_BUILD \"\"\n")
endif()
set(old "")
if(EXISTS "${OUT}")
  file(READ "${OUT}" old)
endif()
if(NOT old STREQUAL text)
  file(WRITE "${OUT}" "${text}")
endif()
