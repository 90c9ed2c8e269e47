-- idempotent: completion and release, the writes of every executed call, as one short
-- script without record.lua's helper functions (a script's body runs on every call, so
-- every helper it defines is built again each time).
--
-- KEYS[1]  the record's key
-- ARGV[1]  the operation: complete | release | reopen (an operator's: any state)
-- ARGV[2]  the owner's token
-- complete: ARGV[3] ttl ms, ARGV[4] result ('' for none), and, when the owner knows its
--           claim's fence, ARGV[5] the head of the in-progress record it holds:
--           'P' .. token .. ('F' .. fingerprint or '-') .. fence .. ':'
--
-- The record is read exactly as record.lua reads it (same format, same checks): a value that
-- is not such a record, or a key of another type, answers IDEMPOTENT_CORRUPT and is left as
-- it is. The fence is carried over as written. One exception: a value that starts with the
-- head the owner sent (its own 16-byte token included, which only its claim wrote) is
-- completed without reading the fields after the fence (the lease end and the claim's time,
-- which a completion discards).

local v = redis.pcall('GET', KEYS[1])
-- The common completion first: the key still holds the owner's claim, with the head the owner
-- knows (state, its token, fingerprint and fence, which a record's first fields are, the
-- fence ended by its ':'). The completed record is that head's fields, no lease, the result:
-- what the general path below writes for it, with no parsing.
if ARGV[5] and type(v) == 'string' and string.find(v, ARGV[5], 1, true) == 1 then
  redis.call('SET', KEYS[1], 'C' .. string.sub(ARGV[5], 2) .. '0:' .. ARGV[4], 'PX', ARGV[3])
  return 1
end
if type(v) == 'table' then
  return redis.error_reply('IDEMPOTENT_CORRUPT value of another type: ' .. tostring(v.err))
end
if not v then return 0 end
local state = string.sub(v, 1, 1)
if state ~= 'P' and state ~= 'C' and state ~= 'R' then
  return redis.error_reply('IDEMPOTENT_CORRUPT unknown state')
end
local marker, pos = string.sub(v, 18, 18), 19
if marker == 'F' then
  pos = 35
elseif marker ~= '-' then
  return redis.error_reply('IDEMPOTENT_CORRUPT no fingerprint marker')
end
local fence, lease_end = string.match(v, '^(%d+):(%d+):', pos)
if not fence then
  return redis.error_reply('IDEMPOTENT_CORRUPT malformed fence or lease')
end
if tonumber(fence) > 9007199254740990 or tonumber(lease_end) > 9007199254740990 then
  return redis.error_reply('IDEMPOTENT_CORRUPT number out of range')
end
if string.sub(v, 2, 17) ~= ARGV[2] then return 0 end

if ARGV[1] == 'complete' then
  if state == 'C' then return 1 end
  if state ~= 'P' then return 0 end
  -- State, token and fingerprint as they were, the fence, no lease, the result.
  redis.call('SET', KEYS[1], 'C' .. string.sub(v, 2, pos - 1) .. fence .. ':0:' .. ARGV[4],
    'PX', ARGV[3])
  return 1
elseif ARGV[1] == 'release' then
  if state ~= 'P' then return 0 end
  redis.call('SET', KEYS[1], 'R' .. ARGV[2] .. '-' .. fence .. ':0:', 'KEEPTTL')
  return 1
elseif ARGV[1] == 'reopen' then
  redis.call('SET', KEYS[1], 'R' .. ARGV[2] .. '-' .. fence .. ':0:', 'KEEPTTL')
  return 1
end

return redis.error_reply('idempotent: unknown operation ' .. tostring(ARGV[1]))
