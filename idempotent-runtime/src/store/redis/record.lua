-- idempotent: every record primitive, one atomic script, called by hash.
--
-- KEYS[1]  the record's key (one key per record, so one Redis Cluster slot)
-- ARGV[1]  the operation: claim | complete | release | renew, or an operator's:
--          delete | delete_corrupt
--
-- A record is one string:
--   state (1 byte: P in progress, C completed, R released)
--   token (16 bytes)
--   'F' + fingerprint (16 bytes), or '-'
--   fence ':' lease-end-in-ms ':' result bytes
-- An in-progress record has no result: its last field is the time of the claim in ms (empty
-- in records written before it was kept), which renewals keep.
-- Times are the server's clock (TIME); expiry is the key's PX. Durations arrive as whole
-- milliseconds, already clamped to a century by the client.
--
-- Numbers are Lua doubles: fences (microseconds since the epoch, then + 1) and times stay
-- below 2^53, where every integer is exact, and are written with '%d', never as floats.
--
-- A value under the key that is not such a record (a foreign write, a key of another type)
-- is never read as free nor overwritten: every operation answers an error whose code is
-- IDEMPOTENT_CORRUPT.

local key = KEYS[1]
local op = ARGV[1]

-- The largest fence a record may hold: one more is still an exact integer.
local MAX_FENCE = 9007199254740990

local function corrupt(why)
  return redis.error_reply('IDEMPOTENT_CORRUPT ' .. why)
end

-- The server's clock: milliseconds and microseconds since the Unix epoch.
local function clock()
  local t = redis.call('TIME')
  local s, us = tonumber(t[1]), tonumber(t[2])
  return s * 1000 + math.floor(us / 1000), s * 1000000 + us
end

-- The value under the key: a string, false when there is none, or nil and why it is no record.
local function get()
  local v = redis.pcall('GET', key)
  if type(v) == 'table' then return nil, 'value of another type: ' .. tostring(v.err) end
  return v
end

-- The record in v, or nil and why v is no record.
local function decode(v)
  local state = string.sub(v, 1, 1)
  if state ~= 'P' and state ~= 'C' and state ~= 'R' then return nil, 'unknown state' end
  local marker = string.sub(v, 18, 18)
  local fp, pos = false, 19
  if marker == 'F' then
    fp, pos = string.sub(v, 19, 34), 35
  elseif marker ~= '-' then
    return nil, 'no fingerprint marker'
  end
  local fence, lease_end, rest = string.match(v, '^(%d+):(%d+):()', pos)
  if not fence then return nil, 'malformed fence or lease' end
  fence, lease_end = tonumber(fence), tonumber(lease_end)
  if fence > MAX_FENCE or lease_end > MAX_FENCE then return nil, 'number out of range' end
  return {
    state = state,
    token = string.sub(v, 2, 17),
    fp = fp,
    fence = fence,
    lease_end = lease_end,
    result = string.sub(v, rest),
  }
end

-- The record under the key (false when there is none), or nil and why it cannot be read.
local function load()
  local v, why = get()
  if not v then return v, why end
  return decode(v)
end

local function encode(state, token, fp, fence, lease_end, result)
  local f = '-'
  if fp then f = 'F' .. fp end
  return state .. token .. f .. string.format('%d', fence) .. ':' ..
    string.format('%d', lease_end) .. ':' .. result
end

if op == 'claim' then
  -- ARGV: token, lease ms, the record's lifetime ms (the longer of ttl and lease, which the
  -- client computes), fingerprint ('' for none)
  local token, lease = ARGV[2], tonumber(ARGV[3])
  local fp = ARGV[5]
  if fp == '' then fp = false end
  local r, why = load()
  if r == nil then return corrupt(why) end
  local now, now_us = clock()
  -- No record: the clock, so fences keep growing across expiry.
  local fence = now_us
  if r then
    -- The same owner claiming again (a retry after a lost reply).
    if r.state == 'P' and r.token == token then return {1, r.fence} end
    local mismatch = fp and r.fp and fp ~= r.fp
    if r.state == 'C' then
      if mismatch then return {4, r.fence} end
      return {2, r.fence, r.result}
    elseif r.state == 'P' then
      if mismatch then return {4, r.fence} end
      if r.lease_end > now then return {3, r.fence} end
    end
    fence = r.fence + 1
  end
  redis.call('SET', key, encode('P', token, fp, fence, now + lease, string.format('%d', now)),
    'PX', ARGV[4])
  return {1, fence}

elseif op == 'complete' then
  -- ARGV: token, ttl ms, result ('' for none)
  local r, why = load()
  if r == nil then return corrupt(why) end
  if not r or r.token ~= ARGV[2] then return 0 end
  if r.state == 'C' then return 1 end
  if r.state ~= 'P' then return 0 end
  redis.call('SET', key, encode('C', ARGV[2], r.fp, r.fence, 0, ARGV[4]), 'PX', ARGV[3])
  return 1

elseif op == 'release' then
  -- ARGV: token
  local r, why = load()
  if r == nil then return corrupt(why) end
  if not r or r.token ~= ARGV[2] or r.state ~= 'P' then return 0 end
  redis.call('SET', key, encode('R', ARGV[2], false, r.fence, 0, ''), 'KEEPTTL')
  return 1

elseif op == 'renew' then
  -- ARGV: token, lease ms
  local r, why = load()
  if r == nil then return corrupt(why) end
  if not r or r.token ~= ARGV[2] or r.state ~= 'P' then return 0 end
  local lease = tonumber(ARGV[3])
  local px = redis.call('PTTL', key)
  if px < lease then px = lease end
  redis.call('SET', key, encode('P', ARGV[2], r.fp, r.fence, clock() + lease, r.result),
    'PX', string.format('%d', px))
  return 1

elseif op == 'delete' then
  -- ARGV: token. A record of any state with this token, except a live claim: an owner that
  -- renewed since the operator read the record may be running.
  local r, why = load()
  if r == nil then return corrupt(why) end
  if not r or r.token ~= ARGV[2] then return 0 end
  if r.state == 'P' and r.lease_end > clock() then return 0 end
  redis.call('DEL', key)
  return 1

elseif op == 'delete_corrupt' then
  -- A value that is not a record: what every other operation refuses to touch.
  local r = load()
  if r ~= nil then return 0 end
  redis.call('DEL', key)
  return 1
end

return redis.error_reply('idempotent: unknown operation ' .. tostring(op))
