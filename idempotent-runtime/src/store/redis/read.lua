-- idempotent: a record's read on a Redis Cluster, as one short script without record.lua's
-- helper functions (on one server, the client sends GET, PTTL and TIME in one pipeline).
--
-- KEYS[1]  the record's key
--
-- Answers the value (false when there is none), the server's time in milliseconds and the
-- key's PTTL, read together. The client checks that the value is a record in record.lua's
-- format (wire.rs, `parse_record`, holds every check record.lua's `decode` makes) and
-- answers IDEMPOTENT_CORRUPT's kind of error for one that is not. A key of another type
-- answers IDEMPOTENT_CORRUPT here, as every operation does.

local v = redis.pcall('GET', KEYS[1])
if type(v) == 'table' then
  return redis.error_reply('IDEMPOTENT_CORRUPT value of another type: ' .. tostring(v.err))
end
local t = redis.call('TIME')
return {v, tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), redis.call('PTTL', KEYS[1])}
