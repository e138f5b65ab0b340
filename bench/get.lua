-- get.lua - GET without an Idempotency-Key (not covered by the POST-only
-- route: idemproxy passes it through, nothing is stored).
--   wrk -s bench/get.lua URL -- [PATH]
local here = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
dofile(here .. "report.lua")

local req

function init(args)
   req = wrk.format("GET", args[1] or "/v1/payments/pay_bench", nil, nil)
end

function request()
   return req
end
