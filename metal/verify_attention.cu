#include "dialect.h"
#include "verify_attention.h"
