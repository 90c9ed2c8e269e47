-- idempotent: every record primitive, one atomic script, called by hash.
--
-- KEYS[1]  the record's key (one key per record, so one Redis Cluster slot)
-- ARGV[1]  the operation: claim | complete | release | renew | read
--
-- A record is one string:
--   state (1 byte: P in progress, C completed, R released)
--   token (16 bytes)
--   'F' + fingerprint (16 bytes), or '-'
--   fence ':' lease-end-in-ms ':' result bytes
-- Times are the server's clock (TIME); expiry is the key's PX.

local key = KEYS[1]
local op = ARGV[1]

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function decode(v)
  local pos = 19
  local fp = false
  if string.sub(v, 18, 18) == 'F' then
    fp = string.sub(v, 19, 34)
    pos = 35
  end
  local c1 = string.find(v, ':', pos, true)
  local c2 = string.find(v, ':', c1 + 1, true)
  return {
    state = string.sub(v, 1, 1),
    token = string.sub(v, 2, 17),
    fp = fp,
    fence = tonumber(string.sub(v, pos, c1 - 1)),
    lease_end = tonumber(string.sub(v, c1 + 1, c2 - 1)),
    result = string.sub(v, c2 + 1),
  }
end

local function encode(state, token, fp, fence, lease_end, result)
  local f = '-'
  if fp then f = 'F' .. fp end
  return state .. token .. f .. string.format('%d', fence) .. ':' ..
    string.format('%d', lease_end) .. ':' .. result
end

local function owned(token)
  local v = redis.call('GET', key)
  if not v then return false end
  local r = decode(v)
  if r.token ~= token then return false end
  return r
end

if op == 'claim' then
  -- ARGV: token, lease ms, ttl ms, fingerprint ('' for none)
  local token, lease, ttl = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
  local fp = ARGV[5]
  if fp == '' then fp = false end
  local now = now_ms()
  local fence = 0
  local v = redis.call('GET', key)
  if v then
    local r = decode(v)
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
    fence = r.fence
  end
  fence = fence + 1
  local px = ttl
  if lease > px then px = lease end
  redis.call('SET', key, encode('P', token, fp, fence, now + lease, ''), 'PX', px)
  return {1, fence}

elseif op == 'complete' then
  -- ARGV: token, ttl ms, result ('' for none)
  local r = owned(ARGV[2])
  if not r then return 0 end
  if r.state == 'C' then return 1 end
  if r.state ~= 'P' then return 0 end
  redis.call('SET', key, encode('C', ARGV[2], r.fp, r.fence, 0, ARGV[4]), 'PX', tonumber(ARGV[3]))
  return 1

elseif op == 'release' then
  -- ARGV: token
  local r = owned(ARGV[2])
  if not r or r.state ~= 'P' then return 0 end
  redis.call('SET', key, encode('R', ARGV[2], false, r.fence, 0, ''), 'KEEPTTL')
  return 1

elseif op == 'renew' then
  -- ARGV: token, lease ms
  local r = owned(ARGV[2])
  if not r or r.state ~= 'P' then return 0 end
  local lease = tonumber(ARGV[3])
  local px = redis.call('PTTL', key)
  if px < lease then px = lease end
  redis.call('SET', key, encode('P', ARGV[2], r.fp, r.fence, now_ms() + lease, ''), 'PX', px)
  return 1

elseif op == 'read' then
  local v = redis.call('GET', key)
  if not v then return {false, now_ms()} end
  return {v, now_ms()}
end

return redis.error_reply('idempotent: unknown operation ' .. tostring(op))
