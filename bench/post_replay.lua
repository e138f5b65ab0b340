-- post_replay.lua - POST the same body with the SAME Idempotency-Key on every
-- request; bench/run completes that key first (one curl), so every request
-- of the run is a replay of a COMPLETE record.
--   wrk -s bench/post_replay.lua URL -- KEY [PATH]
local here = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
dofile(here .. "report.lua")

local req

function init(args)
   local key = args[1] or "bench-replay"
   local path = args[2] or "/v1/payments"
   req = wrk.format("POST", path,
                    { ["Content-Type"] = "application/json", ["Idempotency-Key"] = key },
                    '{"amount":100,"currency":"EUR","customer":"cus_bench"}')
end

function request()
   return req
end
