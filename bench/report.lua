-- report.lua - shared by the bench/*.lua wrk scripts: at the end of a run,
-- print one machine-readable line that bench/run parses (numbers in
-- microseconds, counts as integers). Loaded with dofile() from the scripts.
--
-- wrk 4.1.0 corrects its latency histogram for coordinated omission before
-- done() sees it (stats_correct() in its main(): every latency of more than
-- twice the mean cycle of a connection adds samples below it). With
-- BENCH_HIST=1 in the environment, a second line gives that histogram whole
-- ("BENCH_HIST value:count,..."), from which bench/run takes the correction
-- back out to report the latencies of the requests wrk actually sent.
function done(summary, latency, requests)
   local e = summary.errors
   io.write(string.format(
      "BENCH_RESULT {\"requests\":%d,\"duration_us\":%d,\"bytes\":%d," ..
      "\"p50_us\":%d,\"p90_us\":%d,\"p99_us\":%d,\"p999_us\":%d," ..
      "\"max_us\":%d,\"mean_us\":%.1f," ..
      "\"err_connect\":%d,\"err_read\":%d,\"err_write\":%d," ..
      "\"err_status\":%d,\"err_timeout\":%d}\n",
      summary.requests, summary.duration, summary.bytes,
      latency:percentile(50), latency:percentile(90), latency:percentile(99),
      latency:percentile(99.9), latency.max, latency.mean,
      e.connect, e.read, e.write, e.status, e.timeout))
   if os.getenv("BENCH_HIST") == "1" then
      -- wrk finds the i-th value by scanning from the lowest: the dump costs
      -- CPU (up to a few tenths of a second); its own line says how much, so
      -- that bench/run can leave it out of wrk's CPU a request.
      local t0 = os.clock()
      local parts = {}
      for i = 1, #latency do
         local v, c = latency(i)
         parts[#parts + 1] = string.format("%d:%d", v, c)
      end
      io.write("BENCH_HIST " .. table.concat(parts, ",") .. "\n")
      io.write(string.format("BENCH_HIST_CPU %.6f\n", os.clock() - t0))
   end
end
