-- post_unique.lua - POST a small JSON body with a NEW Idempotency-Key on every
-- request: "<run nonce>-<thread>-<counter>", so keys never repeat within a
-- run, across threads, or across runs on the same store.
--   wrk -s bench/post_unique.lua URL -- NONCE [PATH]
-- The direct and nginx_proxy legs use this same script (nginx ignores the
-- header), so every leg pays the same client-side cost.
local here = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
dofile(here .. "report.lua")

local threads = {}
local next_id = 1

function setup(thread)
   thread:set("tid", next_id)
   next_id = next_id + 1
   table.insert(threads, thread)
end

local nonce = "run"
local path = "/v1/payments"
local counter = 0
local body = '{"amount":100,"currency":"EUR","customer":"cus_bench"}'
local headers = { ["Content-Type"] = "application/json" }

function init(args)
   if args[1] then nonce = args[1] end
   if args[2] then path = args[2] end
end

function request()
   counter = counter + 1
   headers["Idempotency-Key"] = nonce .. "-" .. tostring(tid) .. "-" .. counter
   return wrk.format("POST", path, headers, body)
end
